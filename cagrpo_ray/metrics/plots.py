"""End-of-run plots (PNG) and the summary of a run's metrics (the trainer writes it as JSON).

Each figure plots the metric series of one concern over learner steps; a series is drawn
when its key is in the log, so a loss without kernel weights simply has an empty panel.
A per-step series is drawn twice: faint, as logged, and solid, as its centred moving average
over `SMOOTH_WINDOW` steps (fewer at the ends, where the window is cut to the steps there
are; unlike an exponential average it does not lag the raw line). Sparse series (the
`eval/` evaluations every `run.eval_every` steps) are drawn as points, unsmoothed. The reward
figure marks the held-out evaluation before and after training (pass@1, with its standard
error over the held-out prompts when the per-prompt results are there).
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
SMOOTH_WINDOW = 9  # steps in the centred moving average (odd: the step itself in the middle)
SPARSE_PREFIX = "eval/"  # every run.eval_every steps: points, not a smoothed line


def moving_average(values: list[float], window: int = SMOOTH_WINDOW) -> list[float]:
    """Centred moving average: out[i] = mean(values[i - h : i + h + 1]) with h = window // 2,
    the slice cut to the series at both ends (so out[0] averages h + 1 values)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def held_out_marks(summary: dict | None) -> list[tuple[str, int, float, float | None]]:
    """(label, step, pass@1, standard error or None) of the held-out evaluations before (step
    0) and after (the final step) training. The standard error is that of the mean over the
    held-out prompts of each prompt's fraction of correct samples."""
    marks = []
    summary = summary or {}
    for label, key, step in (
        ("before", "eval_before", 0),
        ("after", "eval_after", summary.get("final_step")),
    ):
        result = summary.get(key) or {}
        if step is None or not isinstance(result.get("pass@1"), int | float):
            continue
        per_prompt, samples = result.get("per_prompt"), result.get("samples")
        stderr = None
        if per_prompt and samples and len(per_prompt) > 1:
            rates = [p["num_correct"] / samples for p in per_prompt]
            mean = sum(rates) / len(rates)
            var = sum((r - mean) ** 2 for r in rates) / (len(rates) - 1)
            stderr = math.sqrt(var / len(rates))
        marks.append((label, int(step), float(result["pass@1"]), stderr))
    return marks


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


def plot_run(records: list[dict], out_dir: str | Path, summary: dict | None = None) -> list[Path]:
    """Write one PNG per figure in FIGURES (those of OPTIONAL_FIGURES only with data);
    returns the paths written. `summary` (eval_before, eval_after, final_step, as the run's
    summary holds them) adds the held-out evaluations to the reward figure."""
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
            if key.startswith(SPARSE_PREFIX):
                ax.plot(steps, values, marker="o", markersize=4, linestyle=":", label=key)
                continue
            (raw,) = ax.plot(steps, values, alpha=0.25, linewidth=1)
            ax.plot(steps, moving_average(values), color=raw.get_color(), linewidth=2, label=key)
        marks = held_out_marks(summary) if name == "reward" else []
        for label, step, value, stderr in marks:
            ax.errorbar([step], [value], yerr=None if stderr is None else [stderr], fmt="D",
                        markersize=7, capsize=4, color="black" if label == "after" else "grey",
                        label=f"held-out pass@1 {label}: {value:.3f}"
                        + ("" if stderr is None else f" ± {stderr:.3f}"))  # fmt: skip
        if series and any(not k.startswith(SPARSE_PREFIX) for k in series):
            ax.plot([], [], color="grey", alpha=0.25, label="raw per step (faint)")
            ax.plot(
                [], [], color="grey", linewidth=2, label=f"moving average, {SMOOTH_WINDOW} steps"
            )
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.set_ylabel(ylabel)
        if series or marks:
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
