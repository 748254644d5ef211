"""Round 3's figure: the finished grid and seeds runs' training and validation signals.

Drawn from what the rules may read (the runs' `metrics.jsonl` and summaries): per-step
entropy and response length, and validation pass@1 at T=0.7 and greedy at each evaluation
(step 0 from the summary's `eval_before`). The test split is not drawn.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"grpo": "C0", "cagrpo": "C3"}
LINES = {"1e-5": ":", "3e-5": "--", "1e-4": "-"}
SMOOTH = 3  # steps of the trailing running mean of the per-step curves


def _running_mean(values: list[float], n: int = SMOOTH) -> list[float]:
    return [statistics.fmean(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def _evaluations(records: list[dict], summary: dict, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of validation metric `key` (e.g. "pass@1", "T0/pass@1"): step 0 from
    `eval_before`, then every record that evaluated."""
    steps, values = [], []
    if key in summary.get("eval_before", {}):
        steps.append(0)
        values.append(summary["eval_before"][key])
    for r in records:
        if f"eval/{key}" in r:
            steps.append(r["step"])
            values.append(r[f"eval/{key}"])
    return steps, values


def draw(runs: list[tuple[object, list[dict], dict]], path: Path) -> None:
    """One 2 x 2 figure of `runs` ([(plan.Run, metrics records, summary)]): colour by method,
    line style by lr, seeds 2 and 3 thinner than their method's grid run."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    panels = [
        (axes[0, 0], "entropy/mean", f"entropy (nats a token, {SMOOTH}-step mean)"),
        (axes[0, 1], "response/length_mean", f"response length (tokens, {SMOOTH}-step mean)"),
    ]
    for run, records, summary in runs:
        style = dict(
            color=COLORS.get(run.method, "C7"),
            ls=LINES.get(run.lr, "-"),
            lw=1.8 if run.group == "grid" else 1.0,
            alpha=1.0 if run.group == "grid" else 0.6,
        )
        label = f"{run.method} {run.lr} s{run.seed}"
        for ax, key, _ in panels:
            steps = [r["step"] for r in records if key in r]
            values = [r[key] for r in records if key in r]
            ax.plot(steps, _running_mean(values), label=label, **style)
        for ax, key in ((axes[1, 0], "pass@1"), (axes[1, 1], "T0/pass@1")):
            ax.plot(*_evaluations(records, summary, key), marker="o", ms=4, label=label, **style)
    for ax, _, title in panels:
        ax.set(title=title, xlabel="learner step")
    axes[1, 0].set(title="validation pass@1 at T=0.7 (64 prompts x 2)", xlabel="learner step")
    axes[1, 1].set(title="validation pass@1 greedy (64 prompts)", xlabel="learner step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=2)
    fig.suptitle("Round 3, SmolLM2-135M-Instruct at T=0.7: training and validation signals")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
