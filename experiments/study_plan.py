"""What the evidence study runs: the regime, the methods, the seeds and the order of the runs.

Only the plan: `study.py` executes it, `study_page.py` reports on it. Changing the study's
design (a budget, a seed, an ablation) touches this file alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CONFIG = "configs/cpu-tiny.yaml"
METHODS = ("grpo", "clip_cov", "kl_cov", "cagrpo")

# Options shared by every run: no live exporter (several runs must not fight over a port) and no
# periodic checkpoints (they cost time and disk, and nothing here resumes from them).
COMMON = {"metrics.enabled": "false", "run.checkpoint_every": "0"}

# The short probe that chose the regime: a learning rate at which plain GRPO's entropy moves
# visibly over 60 steps (lr 3e-4 had wrecked this policy within 30 steps; 1e-4 barely moved it).
PROBE = {
    "algorithm.lr": "2e-4",
    "algorithm.warmup_steps": "10",
    "run.steps": "60",
    "run.eval_every": "20",
}

# The main grid's budget, identical for every method and seed.
MAIN = dict(PROBE)
SEEDS = (1, 2, 3)

# Execution order. On a CPU shared with other work the budget may run out before the grid is
# complete, so the runs that carry the headline comparison (CA-GRPO vs GRPO over seeds) come
# first, then one seed of each ablation and of each Cov baseline, then more seeds, KL-Cov's
# last. Clip-Cov zeroes the gradient of max(1, 2e-4 x ~2,400) = 1 token per step; KL-Cov, with
# one on-policy optimizer step per batch (ratio exactly 1, so its |log r| penalty has zero
# gradient), should train exactly like GRPO, which its first seed checks.
ORDER = (
    [("main", m, s) for s in SEEDS for m in ("grpo", "cagrpo")]
    + [("ablation", a, SEEDS[0]) for a in ("cagrpo_batch", "cagrpo_unnorm")]
    + [("main", m, SEEDS[0]) for m in ("clip_cov", "kl_cov")]
    + [("main", "clip_cov", s) for s in SEEDS[1:]]
    + [("ablation", a, s) for s in SEEDS[1:] for a in ("cagrpo_batch", "cagrpo_unnorm")]
    + [("main", "kl_cov", s) for s in SEEDS[1:]]
)

# GRPO and CA-GRPO with every kernel weight frozen at 1 must train identically: a short run
# of each, compared step by step.
ONES_CHECK = {**MAIN, "run.steps": "10", "run.eval_every": "0"}


@dataclass(frozen=True)
class Run:
    """One training run: its name (also its folder), its role in the study and its overrides."""

    name: str
    group: str  # probe | ones-check | main | ablation
    method: str
    seed: int
    overrides: dict[str, str] = field(default_factory=dict, hash=False)

    def settings(self) -> dict[str, str]:
        """Every --set of the run, in a fixed order."""
        return {
            "run.name": self.name,
            **COMMON,
            **self.overrides,
            "run.seed": str(self.seed),
        }


def plan() -> list[Run]:
    """All runs of the study, in the order they execute: the probe, the GRPO == CA-GRPO(ones)
    identity check, then the main grid and the ablations in the order of ORDER."""
    runs = [
        Run(f"probe-{m}-s0", "probe", m, 0, {**PROBE, "algorithm.policy_loss": m})
        for m in ("grpo", "cagrpo")
    ]
    runs += [
        Run(
            "ones-grpo-s0", "ones-check", "grpo", 0, {**ONES_CHECK, "algorithm.policy_loss": "grpo"}
        ),
        Run(
            "ones-cagrpo_ones-s0",
            "ones-check",
            "cagrpo_ones",
            0,
            {**ONES_CHECK, "algorithm.policy_loss": "cagrpo", "algorithm.cagrpo_kernel": "ones"},
        ),
    ]
    main = {m: {**MAIN, "algorithm.policy_loss": m} for m in METHODS}
    ablations = {
        "cagrpo_batch": {**MAIN, "algorithm.policy_loss": "cagrpo", "algorithm.cov_scope": "batch"},
        "cagrpo_unnorm": {
            **MAIN,
            "algorithm.policy_loss": "cagrpo",
            "algorithm.cagrpo_kernel": "unnormalized",
        },
    }
    for group, method, seed in ORDER:
        overrides = main[method] if group == "main" else ablations[method]
        prefix = "main" if group == "main" else "abl"
        runs.append(Run(f"{prefix}-{method}-s{seed}", group, method, seed, overrides))
    return runs
