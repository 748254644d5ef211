"""What the third evidence round runs, in what order, and the rules that pick its settings.

The plan of `docs/results/evidence3.md` (fixed before any training run of the round), as code:
`study3.py` executes it. Every rule here reads training signals (`metrics.jsonl`) or the
validation split (the run's own held-out evaluations: `data.eval_size` = the first 64 held-out
prompts); the test split (the next 256 held-out prompts) is read only by `study3.py`'s test
stage, after every training run has ended, and by no rule.

Stages, in order (a cut budget leaves the central comparison):

- probe:  GRPO, 20 steps, at 1e-5, 3e-5 and 1e-4 (seed 1). `probe_lr` takes the highest lr
          whose entropy ratio stays within [0.5, 2] and whose gradient norm stays finite.
- grid:   GRPO and CA-GRPO, 60 steps, at the three lrs `grid_lrs` centres on it (seed 1).
- seeds:  each method at its own `chosen_lr`, seeds 2 and 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONFIG = "configs/cpu-smollm2.yaml"
METHODS = ("grpo", "cagrpo")
PROBE_LRS = ("1e-5", "3e-5", "1e-4")
SEEDS = (2, 3)  # seed 1 is each method's grid run
VALIDATION_SIZE, TEST_SIZE = 64, 256

# Every run: no live exporter or inspector (runs must not fight over ports), a checkpoint every
# 10 steps so that a stopped run resumes (`--resume`), the final policy kept for the test stage,
# the validation split evaluated at T=0.7 (2 samples) and greedy, the per-step policy change.
COMMON = {
    "metrics.enabled": "false",
    "metrics.inspect_every": "0",
    "run.checkpoint_every": "10",
    "run.keep_checkpoints": "1",
    "run.save_policy": "end",
    "algorithm.measure_policy_change": "true",
    "data.eval_size": str(VALIDATION_SIZE),
    "eval.samples": "2",
    "eval.temperature": "0.7",
    "eval.temperatures": "[0]",
    "rollout.temperature": "0.7",
}
PROBE = {"run.steps": "20", "run.eval_every": "0"}
GRID = {"run.steps": "60", "run.eval_every": "20"}

# The rules' thresholds, fixed in the plan.
PROBE_ENTROPY_BAND = (0.5, 2.0)
BROKEN_ENTROPY_RATIO = 3.0
BROKEN_VALIDATION_DROP = 0.05
LOSS = {"grpo": {"algorithm.policy_loss": "grpo"}, "cagrpo": {"algorithm.policy_loss": "cagrpo"}}


@dataclass(frozen=True)
class Run:
    """One training run: its name (also its folder), its stage and its overrides."""

    name: str
    group: str  # probe | grid | seeds
    method: str
    lr: str
    seed: int
    overrides: dict[str, str] = field(default_factory=dict, hash=False)

    def settings(self) -> dict[str, str]:
        """Every --set of the run, in a fixed order."""
        return {
            "run.name": self.name,
            **COMMON,
            **self.overrides,
            **LOSS[self.method],
            "algorithm.lr": self.lr,
            "run.seed": str(self.seed),
        }


def run(group: str, method: str, lr: str, seed: int) -> Run:
    overrides = PROBE if group == "probe" else GRID
    return Run(f"{group}-{method}-lr{lr}-s{seed}", group, method, lr, seed, dict(overrides))


def probe_runs() -> list[Run]:
    return [run("probe", "grpo", lr, 1) for lr in PROBE_LRS]


def grid_runs(center: str) -> list[Run]:
    return [run("grid", m, lr, 1) for m in METHODS for lr in grid_lrs(center)]


def seed_runs(chosen: dict[str, str]) -> list[Run]:
    """Seeds 2 and 3 of each method in `chosen` (those whose lr the rule has chosen)."""
    return [run("seeds", m, chosen[m], s) for m in METHODS if m in chosen for s in SEEDS]


def entropy_ratio(records: list[dict], window: int = 10) -> float:
    """Mean entropy of the last `window` steps over that of the first `window`."""
    values = [r["entropy/mean"] for r in records if "entropy/mean" in r]
    if len(values) < 2 * window:
        raise ValueError(f"{len(values)} steps with entropy: the ratio needs {2 * window}")
    first, last = values[:window], values[-window:]
    return (sum(last) / window) / (sum(first) / window)


def probe_lr(records_by_lr: dict[str, list[dict]]) -> tuple[str | None, dict[str, str]]:
    """The highest probe lr with entropy ratio in PROBE_ENTROPY_BAND and every gradient norm
    finite (None if none), and why each lr passed or failed."""
    why, stable = {}, []
    for lr, records in records_by_lr.items():
        ratio = entropy_ratio(records)
        finite = all(math.isfinite(r.get("learner/grad_norm", math.nan)) for r in records)
        low, high = PROBE_ENTROPY_BAND
        ok = finite and low <= ratio <= high
        why[lr] = f"entropy ratio {ratio:.2f}, grad norm {'finite' if finite else 'not finite'}"
        if ok:
            stable.append(lr)
    best = max(stable, key=float) if stable else None
    return best, why


def grid_lrs(center: str | None) -> tuple[str, str, str]:
    """Three lrs a factor ~3 apart with the probe's highest stable lr in the middle (with none
    stable: the middle a factor 3 below the lowest probe lr)."""
    ladder = ("1e-6", "3e-6", "1e-5", "3e-5", "1e-4", "3e-4", "1e-3")
    middle = ladder.index(center) if center is not None else ladder.index(PROBE_LRS[0]) - 1
    return ladder[middle - 1], ladder[middle], ladder[middle + 1]


def validation_curve(records: list[dict], summary: dict) -> list[float]:
    """Validation pass@1 at T=0.7 at each evaluation after step 0, in step order. The final
    evaluation counts once: a run whose last step is a multiple of `run.eval_every` evaluates
    it in that step's record and again, the same policy, as `eval_after`."""
    values = [r["eval/pass@1"] for r in records if "eval/pass@1" in r]
    last_step_evaluated = bool(records) and "eval/pass@1" in records[-1]
    if "eval_after" in summary and not last_step_evaluated:
        values.append(summary["eval_after"]["pass@1"])
    return values


def chosen_lr(runs: dict[str, tuple[list[dict], dict]]) -> tuple[str, dict[str, str]]:
    """One method's lr from its grid runs ({lr: (records, summary)}).

    A run is broken if its entropy ratio exceeds BROKEN_ENTROPY_RATIO or its validation pass@1
    falls more than BROKEN_VALIDATION_DROP below the starting policy's at any evaluation; of
    the unbroken runs, the highest mean validation pass@1 over the last two evaluations; ties
    go to the lower lr; if every run is broken, the lowest lr."""
    scores, why = {}, {}
    for lr, (records, summary) in runs.items():
        ratio = entropy_ratio(records)
        start = summary["eval_before"]["pass@1"]
        curve = validation_curve(records, summary)
        drop = start - min(curve)
        broken = ratio > BROKEN_ENTROPY_RATIO or drop > BROKEN_VALIDATION_DROP
        score = sum(curve[-2:]) / len(curve[-2:])
        why[lr] = (
            f"entropy ratio {ratio:.2f}, validation {start:.3f} -> "
            + " / ".join(f"{v:.3f}" for v in curve)
            + (", broken" if broken else f", score {score:.3f}")
        )
        if not broken:
            scores[lr] = score
    if not scores:
        return min(runs, key=float), why
    best = max(scores.values())
    return min((lr for lr, s in scores.items() if s == best), key=float), why
