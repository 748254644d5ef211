"""What the second evidence round runs, in what order, and the rules that pick its settings.

Only the plan and the rules: `study2.py` executes it, `study2_page.py` reports on it. The rules
that choose a setting from runs read training signals or the GRPO search runs only, never a
held-out result of CA-GRPO or of the Cov baselines. They were not all fixed before the runs:
`best_lr` (training accuracy only) was, but candidates D and E and the "broke" exclusion of
`late_regime`'s fallback were added after reading held-out results of GRPO runs (A-C and two
exploratory probes), so regime D and lr 5e-5, where every method of the late grid then runs,
were chosen after reading GRPO runs' held-out results.

Groups, in the order of `ORDER` (the most informative first, so that a cut budget still leaves
a complete comparison):

- sweep:  GRPO and CA-GRPO at three learning rates, round 1's regime (60 steps, 16 prompts x 8,
          one update per batch), seed 1. `best_lr` picks each method's lr by its training
          accuracy over the last 10 steps; `best` then runs seeds 2 and 3 there.
- search: GRPO in five candidate late-phase regimes (several updates per batch, smaller
          batches, longer horizon), seed 1. `late_regime` picks the first whose entropy
          collapses and whose held-out accuracy (T=0.7) falls late, by `collapse_verdict`
          (D and E were added after A-C broke; see CANDIDATES).
- late:   GRPO, Clip-Cov, KL-Cov and CA-GRPO in that regime, seeds 1-3 (GRPO seed 1 is the
          search run itself). Clip-Cov and KL-Cov with their authors' settings: statistics
          from the current policy at every mini-batch, KL-Cov's ratio 2e-3.
- mechanism: CA-GRPO's kernel on c > 0 only, on c < 0 only, and from the current policy at
          every mini-batch instead of the old one, in the late regime, seed 1.
- kappa:  the kernel width kappa * sigma fixed at 2 and 4 (1 is CA-GRPO, infinity GRPO), and
          steered by the entropy controller (algo/controllers.py), late regime; the controller
          also at seeds 2 and 3.

Every run logs the KL between consecutive policies (`policy/kl_step`) and is evaluated on the
held-out split at T=1 (4 samples: pass@1, pass@4, maj@4), T=0.7 and greedy, and on a harder
split (5-6 terms; training has 2-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONFIG = "configs/cpu-tiny.yaml"
SEEDS = (1, 2, 3)
LRS = ("1e-4", "2e-4", "4e-4")  # round 1 ran 2e-4; one step below and one above
# The paper's comparison (CA-GRPO against GRPO) first, so that a cut budget still leaves it.
LATE_METHODS = ("grpo", "cagrpo", "clip_cov", "kl_cov")

# Every run: no live exporter or inspector (several runs must not fight over ports), no
# periodic checkpoints, the per-step policy change, and the evaluation set-up.
COMMON = {
    "metrics.enabled": "false",
    "metrics.inspect_every": "0",
    "run.checkpoint_every": "0",
    "run.save_policy": "never",
    "algorithm.measure_policy_change": "true",
    "data.eval_size": "128",
    "eval.samples": "4",
    "eval.temperatures": "[0.7, 0]",
    "eval.hard_config": "{min_terms: 5, max_terms: 6}",
    "eval.hard_size": "64",
}

# Round 1's regime, for the learning-rate sweep.
SWEEP = {"algorithm.warmup_steps": "10", "run.steps": "60", "run.eval_every": "20"}

# Late-phase candidates for GRPO, in the order they are tried and preferred. Each takes more
# optimizer steps per sample than round 1 (mini-batches, epochs) on smaller batches, longer.
LATE_BASE = {
    "algorithm.warmup_steps": "10",
    "run.steps": "150",
    "run.eval_every": "30",
    "rollout.prompts_per_step": "8",
    "algorithm.mini_batch_size": "16",
}
# A-C were fixed before any search run. All three broke (held-out accuracy far below its start
# within 30 steps), so D and E were added after them, below the lr where GRPO stays stable and
# over a longer horizon; that choice read GRPO runs only, their held-out results included (A-C,
# and two exploratory GRPO runs of A's batch shape at 1e-4, which also broke, and 5e-5, which
# learned steadily for 150 steps).
LONG = {"run.steps": "300", "run.eval_every": "50"}
CANDIDATES = {
    "A": {**LATE_BASE, "algorithm.lr": "2e-4"},
    "B": {**LATE_BASE, "algorithm.lr": "4e-4"},
    "C": {**LATE_BASE, "algorithm.lr": "4e-4", "algorithm.ppo_epochs": "2"},
    "D": {**LATE_BASE, **LONG, "algorithm.lr": "5e-5"},
    "E": {**LATE_BASE, **LONG, "algorithm.lr": "5e-5", "algorithm.ppo_epochs": "2"},
}
ADDED_AFTER_SEARCH = ("D", "E")  # the candidates added once A-C had run
# What "collapse, then a late fall" means, decided before the search ran: the last 10 steps'
# mean entropy at most half the first 10 steps', and the final held-out pass@1 at T=0.7 at
# least LATE_FALL below the best earlier evaluation of the run (after step 0). A run "broke"
# when its final held-out pass@1 at T=0.7 is more than LATE_FALL below its value before
# training: it lost what the warm start knew, and a comparison there would measure how methods
# fail, not the late phase (this test was added with D and E).
COLLAPSE_RATIO = 0.5
LATE_FALL = 0.03

# The Cov baselines as their authors run them (Cui et al. 2025; verl's recipes): statistics
# from the current policy at each mini-batch; Clip-Cov with the PPO clip range opened to
# [0, 2] (their clip ratio 1.0: the covariance selection is its only clipping); KL-Cov at
# ratio 2e-3 (their 7B recipe).
METHOD_OPTIONS = {
    "grpo": {"algorithm.policy_loss": "grpo"},
    "cagrpo": {"algorithm.policy_loss": "cagrpo"},
    "clip_cov": {
        "algorithm.policy_loss": "clip_cov",
        "algorithm.token_stats": "minibatch",
        "algorithm.clip_eps_low": "1.0",
        "algorithm.clip_eps_high": "1.0",
    },
    "kl_cov": {
        "algorithm.policy_loss": "kl_cov",
        "algorithm.token_stats": "minibatch",
        "algorithm.kl_cov_ratio": "2e-3",
    },
}
MECHANISM = {
    "cagrpo_pos": {"algorithm.policy_loss": "cagrpo", "algorithm.cagrpo_kernel": "positive"},
    "cagrpo_neg": {"algorithm.policy_loss": "cagrpo", "algorithm.cagrpo_kernel": "negative"},
    "cagrpo_current": {"algorithm.policy_loss": "cagrpo", "algorithm.token_stats": "minibatch"},
}
KAPPA = {
    "cagrpo_k2": {"algorithm.policy_loss": "cagrpo", "algorithm.cagrpo_kappa": "2"},
    "cagrpo_k4": {"algorithm.policy_loss": "cagrpo", "algorithm.cagrpo_kappa": "4"},
    "cagrpo_ctl": {"algorithm.policy_loss": "cagrpo", "algorithm.kappa_control": "entropy"},
}


@dataclass(frozen=True)
class Run:
    """One training run: its name (also its folder), its group, method, seed and overrides."""

    name: str
    group: str  # sweep | best | search | late | mechanism | kappa
    method: str
    seed: int
    overrides: dict[str, str] = field(default_factory=dict, hash=False)

    def settings(self) -> dict[str, str]:
        """Every --set of the run, in a fixed order."""
        return {"run.name": self.name, **COMMON, **self.overrides, "run.seed": str(self.seed)}


def sweep_runs() -> list[Run]:
    return [
        Run(
            f"sweep-{m}-lr{lr}-s1",
            "sweep",
            m,
            1,
            {**SWEEP, **METHOD_OPTIONS[m], "algorithm.lr": lr},
        )  # fmt: skip
        for lr in LRS
        for m in ("grpo", "cagrpo")
    ]


def search_runs() -> list[Run]:
    return [
        Run(f"search-grpo-{key}-s1", "search", "grpo", 1, {**regime, **METHOD_OPTIONS["grpo"]})
        for key, regime in CANDIDATES.items()
    ]


def best_runs(best_lr: dict[str, str]) -> list[Run]:
    """Seeds 2 and 3 of each method at its own best lr (`best_lr`: method -> lr)."""
    return [
        Run(
            f"best-{m}-lr{lr}-s{s}",
            "best",
            m,
            s,
            {**SWEEP, **METHOD_OPTIONS[m], "algorithm.lr": lr},
        )  # fmt: skip
        for s in SEEDS[1:]
        for m, lr in best_lr.items()
    ]


def late_runs(key: str, seeds=SEEDS) -> list[Run]:
    """The late-phase grid in regime `key` (GRPO seed 1 is search run `key`)."""
    regime = CANDIDATES[key]
    return [
        Run(f"late{key}-{m}-s{s}", "late", m, s, {**regime, **METHOD_OPTIONS[m]})
        for s in seeds
        for m in LATE_METHODS
        if not (m == "grpo" and s == 1)
    ]


def variant_runs(key: str, group: str, variants: dict, seeds=(1,)) -> list[Run]:
    regime = CANDIDATES[key]
    return [
        Run(f"late{key}-{name}-s{s}", group, name, s, {**regime, **options})
        for s in seeds
        for name, options in variants.items()
    ]


def stages(best_lr: dict[str, str] | None, late: str | None) -> list[list[Run]]:
    """The runs in execution order, as stages; a stage that needs a choice not yet made (the
    best lrs, the late regime) is left out until the runs it depends on have finished."""
    out = [sweep_runs(), search_runs()]
    if late is not None:
        out.append(late_runs(late, seeds=(1,)))
        out.append(variant_runs(late, "mechanism", MECHANISM))
        out.append(variant_runs(late, "kappa", KAPPA))
    if best_lr is not None:
        out.append(best_runs(best_lr))
    if late is not None:
        out.append(late_runs(late, seeds=SEEDS[1:]))
        out.append(variant_runs(late, "kappa", {"cagrpo_ctl": KAPPA["cagrpo_ctl"]}, SEEDS[1:]))
    return out


def mean(values) -> float:
    values = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def best_lr(sweep: dict[str, list[dict]]) -> dict[str, str]:
    """Each method's lr with the highest training accuracy (accuracy/train) over its last 10
    steps; `sweep`: run name -> its metric records. Ties go to the smaller lr."""
    best: dict[str, tuple[float, float, str]] = {}
    for run in sweep_runs():
        records = sweep.get(run.name)
        if not records:
            continue
        score = mean(r.get("accuracy/train") for r in records[-10:])
        lr = run.overrides["algorithm.lr"]
        key = (score, -float(lr), lr)
        if run.method not in best or key > best[run.method]:
            best[run.method] = key
    return {method: key[2] for method, key in best.items()}


def collapse_verdict(records: list[dict], heldout: dict[int, dict]) -> dict:
    """Whether a GRPO run shows the late phase (see COLLAPSE_RATIO, LATE_FALL)."""
    entropy = [r["entropy/mean"] for r in records if "entropy/mean" in r]
    ratio = mean(entropy[-10:]) / mean(entropy[:10]) if len(entropy) >= 20 else math.nan
    evals = sorted((s, e.get("T0.7/pass@1", math.nan)) for s, e in heldout.items() if s > 0)
    final = evals[-1][1] if evals else math.nan
    peak = max((v for _, v in evals[:-1]), default=math.nan)
    start = heldout.get(0, {}).get("T0.7/pass@1", math.nan)
    collapsed = ratio <= COLLAPSE_RATIO
    fell = final <= peak - LATE_FALL
    return {
        "entropy_ratio": ratio,
        "start_T0.7": start,
        "peak_T0.7": peak,
        "final_T0.7": final,
        "collapsed": bool(collapsed),
        "fell": bool(fell),
        "broke": bool(final < start - LATE_FALL),
        "late_phase": bool(collapsed and fell),
    }


def late_regime(verdicts: dict[str, dict]) -> tuple[str | None, str]:
    """The first candidate (in CANDIDATES' order) with a late phase; if none has one, the
    one whose entropy fell most among those that did not break (the runs then test the regime
    closest to it); None if every candidate broke. Returns (key, why)."""
    for key in CANDIDATES:
        if verdicts.get(key, {}).get("late_phase"):
            return key, "its entropy collapsed and its held-out accuracy fell late"
    ratios = {k: v["entropy_ratio"] for k, v in verdicts.items() if not v.get("broke")}
    ratios = {k: r for k, r in ratios.items() if math.isfinite(r)}
    if not ratios:
        return None, "no candidate showed a late phase and every one broke"
    key = min(ratios, key=ratios.get)
    why = "no candidate showed a late phase; of those that did not break, this one's entropy"
    return key, why + " fell most"
