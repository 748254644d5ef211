"""Round 4's figure: every tested policy's pass@1 by learning rate, one panel per test split
and setting, each dot a seed; the starting policy as a dashed line.

Drawn from `study4.test_points` (the kept test samples) whenever the runs table is written.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"grpo": "C0", "cagrpo": "C3"}
SPREAD = 1.08  # seeds side by side: seed s sits at lr x SPREAD ** (s - 2)


def draw(points: dict[tuple[str, str], list[dict]], chosen: dict[str, str], path: Path) -> None:
    """A 2 x 2 figure of `points` ({(split, setting): [{name, method, lr, seed, pass@1}]}):
    colour by method; the runs at each method's chosen lr (`chosen`, {method: lr}) drawn
    large, the others small and hollow."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for ax, ((split, setting), rows) in zip(axes.flat, points.items(), strict=False):
        for row in rows:
            if row["method"] == "start":
                ax.axhline(row["pass@1"], color="0.4", ls="--", lw=1)
                continue
            lr = float(row["lr"])
            x = lr * SPREAD ** (row["seed"] - 2)
            color = COLORS.get(row["method"], "C7")
            if chosen.get(row["method"]) == row["lr"]:
                ax.plot(x, row["pass@1"], "o", ms=8, color=color)
            else:
                ax.plot(x, row["pass@1"], "o", ms=5, mfc="none", color=color)
        temperature = "greedy" if setting == "T0" else setting.replace("T", "T=")
        ax.set(title=f"{split}, {temperature}", xscale="log", ylabel="pass@1")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("learning rate (seeds side by side)")
    handles = [
        plt.Line2D([], [], marker="o", ls="", color=COLORS[m], label=label)
        for m, label in (("grpo", "GRPO"), ("cagrpo", "CA-GRPO"))
    ] + [plt.Line2D([], [], color="0.4", ls="--", label="starting policy")]
    axes[0, 0].legend(handles=handles, fontsize=8)
    fig.suptitle(
        "Round 4, SmolLM2-135M-Instruct: test pass@1 by lr "
        "(filled: each method's chosen lr, the verdict's runs; hollow: other grid runs)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
