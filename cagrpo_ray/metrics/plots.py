"""End-of-run plots (PNG) and the summary of a run's metrics (the trainer writes it as JSON).

Each figure plots the metric series of one concern over learner steps; a series is drawn
when its key is in the log, so a loss without kernel weights simply has an empty panel.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# figure name -> (title, y label, metric keys or key prefixes ending in "*")
FIGURES: dict[str, tuple[str, str, list[str]]] = {
    "reward": (
        "Reward and accuracy",
        "mean over samples",
        ["reward/mean", "accuracy/train", "eval/pass@*"],
    ),
    "entropy": ("Policy entropy", "nats per token", ["entropy/mean"]),
    "covariance": ("Covariance of log-prob and advantage", "quantile", ["cov/*"]),
    "kernel_weights": ("CA-GRPO kernel weights", "weight", ["cagrpo/weight_*"]),
    "throughput": ("Throughput", "tokens per second", ["throughput/*"]),
    "time": ("Step time by phase", "seconds", ["time/*"]),
    "tools": (
        "Multi-turn episodes: tool use",
        "per episode, or share of tokens",
        [
            "env/tool_calls_per_episode",
            "env/turns_mean",
            "env/environment_token_fraction",
            "eval/tool_call_fraction",
        ],
    ),  # fmt: skip
}
# Figures drawn only when their series are in the log (a single-turn run has no tool use).
OPTIONAL_FIGURES = {"tools"}


def _series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    keys = sorted({k for r in records for k in r})
    if pattern.endswith("*"):
        keys = [k for k in keys if k.startswith(pattern[:-1])]
    else:
        keys = [k for k in keys if k == pattern]
    out = {}
    for key in keys:
        points = [
            (r["step"], float(r[key]))
            for r in records
            if isinstance(r.get(key), int | float) and math.isfinite(float(r[key]))
        ]
        if points:
            out[key] = ([p[0] for p in points], [p[1] for p in points])
    return out


def plot_run(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Write one PNG per figure in FIGURES (those of OPTIONAL_FIGURES only with data);
    returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (title, ylabel, patterns) in FIGURES.items():
        series = {}
        for pattern in patterns:
            series.update(_series(records, pattern))
        if not series and name in OPTIONAL_FIGURES:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, (steps, values) in series.items():
            ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.set_ylabel(ylabel)
        if series:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def summarize(records: list[dict], extra: dict | None = None) -> dict:
    """First, last, min, max and mean of every numeric series, plus `extra`."""
    summary: dict = {"steps": len(records)}
    keys = sorted({k for r in records for k in r} - {"step"})
    for key in keys:
        values = [
            float(r[key])
            for r in records
            if isinstance(r.get(key), int | float) and math.isfinite(float(r[key]))
        ]
        if values:
            summary[key] = {
                "first": values[0],
                "last": values[-1],
                "min": min(values),
                "max": max(values),
                "mean": sum(values) / len(values),
            }
    summary.update(extra or {})
    return summary
