"""The evidence study's figures: PNGs next to the results page, drawn from the finished runs."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from study_results import Loaded, checkpoints, mean_std  # noqa: E402

COLORS = {
    "grpo": "C0",
    "clip_cov": "C1",
    "kl_cov": "C2",
    "cagrpo": "C3",
    "cagrpo_batch": "C4",
    "cagrpo_unnorm": "C5",
    "cagrpo_ones": "C6",
}


def _mean_curve(items: list[Loaded], key: str, smooth: int = 1) -> tuple[list[int], list[float]]:
    """Mean over runs of a per-step metric at the steps all runs logged, with a trailing
    `smooth`-step running mean."""
    per = [dict(zip(*it.series(key), strict=True)) for it in items]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    mean = [statistics.fmean(p[s] for p in per) for s in steps]
    if smooth > 1:
        mean = [statistics.fmean(mean[max(0, i - smooth + 1) : i + 1]) for i in range(len(mean))]
    return steps, mean


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(groups, key, title, ylabel, path: Path, smooth: int = 1, logy: bool = False):
    """One per-step metric: every run thin, each method's mean over seeds thick."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for method, items in groups.items():
        color = COLORS.get(method)
        for it in items:
            ax.plot(*it.series(key), color=color, alpha=0.18, lw=0.8)
        steps, mean = _mean_curve(items, key, smooth)
        ax.plot(steps, mean, color=color, lw=2, label=f"{method} (n={len(items)})")
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel="learner step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def plot_heldout(groups, path: Path):
    """Held-out pass@1 and pass@4 by checkpoint, mean ± std over seeds per method."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("pass@1", "pass@4"), strict=True):
        for i, (method, items) in enumerate(groups.items()):
            steps = checkpoints(items)
            stats = [mean_std([it.at(s, metric) for it in items]) for s in steps]
            x = [s + (i - 1.5) * 0.6 for s in steps]  # small offsets keep error bars apart
            ax.errorbar(
                x,
                [m for m, _, _ in stats],
                yerr=[0 if math.isnan(sd) else sd for _, sd, _ in stats],
                marker="o",
                capsize=3,
                color=COLORS.get(method),
                label=method,
            )
        ax.set(title=f"held-out {metric} (200 prompts x 4 samples)", xlabel="learner step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(fig, path)


def plot_covariance(groups, path: Path):
    """The extreme covariance quantiles (top and bottom 0.01% and 1%) per method over steps."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for ax, key in zip(
        axes.flat,
        ["cov/pos_0.01pct", "cov/pos_1pct", "cov/neg_0.01pct", "cov/neg_1pct"],
        strict=True,
    ):
        for method, items in groups.items():
            ax.plot(*_mean_curve(items, key, smooth=5), color=COLORS.get(method), label=method)
        ax.set_title(key.replace("pos_", "top ").replace("neg_", "bottom ").replace("pct", "%"))
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("learner step (5-step running mean)")
    _save(fig, path)


def plot_kernel(items: list[Loaded], path: Path):
    """CA-GRPO's kernel-weight statistics over steps, one line per run."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    # weight_min is ~0 at every step (the extreme token's kernel underflows), so it is not drawn
    for ax, key in zip(
        axes,
        ["cagrpo/weight_p01", "cagrpo/weight_frac_below_0.5", "cagrpo/weight_max"],
        strict=True,
    ):
        for i, it in enumerate(items):
            ax.plot(*it.series(key), color=f"C{i % 10}", alpha=0.8, lw=1, label=it.run.name)
        ax.set(title=key, xlabel="learner step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _save(fig, path)


def draw_figures(main, probe, ablation, kernel_runs: list[Loaded], figs: Path) -> None:
    """Every figure of the page into `figs`; a figure whose runs have not finished is skipped.
    `main`, `probe` and `ablation` are runs by method; `ablation` includes the seed-matched
    main-grid GRPO and CA-GRPO runs it is compared with."""
    figs.mkdir(parents=True, exist_ok=True)
    if main:
        plot_curves(
            main,
            "entropy/mean",
            "Policy entropy on the training batches, main grid",
            "nats per token",
            figs / "entropy.png",
        )
        plot_curves(
            main,
            "accuracy/train",
            "Training accuracy (5-step running mean)",
            "fraction correct",
            figs / "train_accuracy.png",
            smooth=5,
        )
        plot_curves(
            main,
            "response/length_mean",
            "Mean response length (5-step running mean)",
            "tokens",
            figs / "response_length.png",
            smooth=5,
        )
        plot_heldout(main, figs / "heldout.png")
        plot_covariance(main, figs / "covariance.png")
    if probe:
        title = "Probe: policy entropy"
        plot_curves(probe, "entropy/mean", title, "nats per token", figs / "probe_entropy.png")
    if any(it.run.group == "ablation" for items in ablation.values() for it in items):
        title = "Ablations (seed-matched): policy entropy"
        plot_curves(
            ablation, "entropy/mean", title, "nats per token", figs / "ablation_entropy.png"
        )
    if kernel_runs:
        plot_kernel(kernel_runs, figs / "kernel_weights.png")
