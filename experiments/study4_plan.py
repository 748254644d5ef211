"""What the fourth evidence round runs, the second test split it adds, and its rules.

The plan of `docs/results/evidence4.md` (fixed before any run of the round), as code; `study4.py`
executes it. Round 3 (`study3_plan.py`, `docs/results/evidence3.md`) chose lr 1e-5 for both
methods, the lowest of its grid; round 4 extends the grid downward with round 3's rule, seeds,
steps and pinned commit, so that round 3's runs are members of the same grid:

- grid:   GRPO and CA-GRPO at 3e-6 (seed 1), beside round 3's 1e-5, 3e-5 and 1e-4; then, if
          3e-6 is either method's choice (round 3's rule, `study3_plan.chosen_lr`), both at
          1e-6 too, and each method's lr is chosen again from all five.
- seeds:  seeds 2 and 3 of each method at its chosen lr (round 3's where that lr is 1e-5).
- test:   every policy of the verdict (seeds 1-3 at each method's lr) and the starting one on
          round 3's test split (`test1`, 256 prompts) and on a second one drawn like the
          training prompts (`test2`, `test2_rows`), every sample kept (`study4_eval.py`).

The verdict reads test2 at T=0.7 (`verdict`); "supports" and "contradicts" need the same
evidence, mirrored, and a t-interval over the seeds is reported beside either.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter

import study3_plan as round3

CONFIG = round3.CONFIG
METHODS = round3.METHODS
SEEDS = round3.SEEDS
ROUND3_GRID = ("1e-5", "3e-5", "1e-4")
FIRST_GRID = ("3e-6", *ROUND3_GRID)
EXTENSION, FURTHER = "3e-6", "1e-6"  # 1e-6 joins the grid if 3e-6 is either method's choice

# The splits: round 3's (held-out prompts 64-319, every question of the 20,000-prompt training
# split excluded) and the second, drawn like the training prompts.
DATASET, DATASET_CONFIG = "basic_arithmetic", {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
}  # fmt: skip
TRAIN_SIZE = 20_000  # data.train_size of every run: the pool round 3's test split excludes
TRAINED_PROMPTS = 60 * 4  # run.steps x rollout.prompts_per_step: train items 0..239, in order
VALIDATION_SIZE, TEST1_SIZE, TEST2_SIZE = 64, 256, 1_000
# reasoning_gym seeds item i with seed + i: the splits use 0 (train), 100,000,000 (sft) and
# 200,000,000 (eval) onwards, so the second test split draws from a region none of them reach.
TEST2_SEED = 300_000_000
# Each split's settings: (temperature, samples a prompt). Round 3's split as round 3 tested it;
# the second with 2 samples at T=0.7: its 1,000 prompts, not the samples, set the precision
# (a seed's paired SE about 0.011 with 2 samples, 0.010 with 4, by round 3's per-prompt
# spread, against a seed-to-seed sd of 0.025), and 4 would cost ~40% more evaluation time.
TEST_SETTINGS = {
    "test1": {"T0.7": ("0.7", "4"), "T0": ("0", "1")},
    "test2": {"T0.7": ("0.7", "2"), "T0": ("0", "1")},
}
SPLITS = tuple(TEST_SETTINGS)
PRIMARY = ("test2", "T0.7")  # the verdict's split and setting

# The decision rule's threshold: the same in both directions.
DELTA = 0.03


def run(group: str, method: str, lr: str, seed: int) -> round3.Run:
    """A run of round 4: round 3's settings and names, so that its runs are round 4's too."""
    return round3.run(group, method, lr, seed)


def grid_runs(lrs) -> list[round3.Run]:
    """Seed 1 of both methods at each lr of `lrs`."""
    return [run("grid", m, lr, 1) for m in METHODS for lr in lrs]


def seed_runs(chosen: dict[str, str]) -> list[round3.Run]:
    return round3.seed_runs(chosen)


def verdict_runs(chosen: dict[str, str]) -> list[round3.Run]:
    """The runs the verdict reads: seeds 1 (the grid run), 2 and 3 at each method's lr."""
    return [
        run("grid" if seed == 1 else "seeds", m, chosen[m], seed)
        for m in METHODS
        if m in chosen
        for seed in (1, *SEEDS)
    ]


def grid_lrs(first_choices: dict[str, str]) -> tuple[tuple[str, ...], bool]:
    """(the grid's lrs, whether that grid is final) from the methods' choices over FIRST_GRID
    so far: 1e-6 joins as soon as either method chooses 3e-6; without that the grid is final
    once both methods have chosen."""
    if EXTENSION in first_choices.values():
        return (FURTHER, *FIRST_GRID), True
    return FIRST_GRID, set(first_choices) == set(METHODS)


chosen_lr = round3.chosen_lr  # round 3's rule, unchanged


def form(expression: str) -> str:
    """A question's form: its expression with numbers as `n` and the operator as `op`
    ("( -( -8 / 2 ) )" -> "( -( n op n ) )")."""
    return re.sub(r"[-+*/](?= n)", "op", re.sub(r"-?\d+", "n", expression))


def coarse_form(form_: str) -> str:
    """The strata: "plain" (n op n), "parenthesised" (no negated group), "negated" (a -( ))."""
    if "(" not in form_:
        return "plain"
    return "negated" if "-(" in form_ else "parenthesised"


def quotas(counts: Counter, size: int) -> dict[str, int]:
    """`size` split over the strata in proportion to `counts` (largest remainder)."""
    total = sum(counts.values())
    exact = {k: size * n / total for k, n in counts.items()}
    out = {k: math.floor(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], k))[: size - sum(out.values())]:
        out[k] += 1
    return out


def _entries(seed: int, size: int) -> list[dict]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(DATASET, seed=seed, size=size, **DATASET_CONFIG)
    return [dataset[i] for i in range(size)]


def excluded_questions() -> set[str]:
    """The questions the second test split must not hold: the prompts the runs trained on
    (train items 0..TRAINED_PROMPTS-1) and round 3's validation and test prompts."""
    from cagrpo_ray.data import ReasoningGymSource

    held_out = ReasoningGymSource(
        DATASET, DATASET_CONFIG, seed=0, size=VALIDATION_SIZE + TEST1_SIZE, split="eval",
        exclude_sizes={"train": TRAIN_SIZE},
    )  # fmt: skip
    trained = ReasoningGymSource(DATASET, DATASET_CONFIG, seed=0, size=TRAINED_PROMPTS)
    return {item.question for source in (held_out, trained) for item in source.iter_from(0)}


def training_strata() -> Counter:
    """Coarse forms of the whole training split (20,000 prompts): the proportions to match."""
    return Counter(coarse_form(form(e["metadata"]["expression"])) for e in _entries(0, TRAIN_SIZE))


def test2_rows(size: int = TEST2_SIZE) -> list[dict]:
    """The second test split: fresh items of the same generator (seed region TEST2_SEED), each
    question once, none of `excluded_questions`, taken in draw order within each stratum until
    the stratum holds its quota (`quotas` of the training split's proportions). Rows in draw
    order, as `.jsonl` rows for `FilePromptSource` (question, answer, and the metadata the
    verifier reads: source_dataset; with the form and stratum for the tables)."""
    want = quotas(training_strata(), size)
    seen = excluded_questions()
    have: Counter = Counter()
    rows: list[dict] = []
    drawn, chunk = 0, 4 * size
    while sum(have.values()) < size:
        if drawn > 40 * size:
            raise ValueError(f"the strata {dict(want)} are not filled in {drawn} draws: {have}")
        for offset, entry in enumerate(_entries(TEST2_SEED + drawn, chunk)):
            question = entry["question"]
            stratum = coarse_form(form(entry["metadata"]["expression"]))
            if question in seen or have[stratum] >= want[stratum]:
                continue
            seen.add(question)
            have[stratum] += 1
            rows.append({
                "question": question, "answer": str(entry["answer"]),
                "source_dataset": DATASET, "expression": entry["metadata"]["expression"],
                "form": form(entry["metadata"]["expression"]), "stratum": stratum,
                "draw": drawn + offset,
            })  # fmt: skip
        drawn += chunk
    return rows


# Statistics of the verdict and of the tables.


def t_quantile_2dof(p: float) -> float:
    """The p quantile of Student's t with 2 degrees of freedom (closed form)."""
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """mean +- t(1 - alpha/2, n - 1) sd / sqrt(n) over `values` (n = 3 here: 2 dof)."""
    if len(values) != 3:
        raise ValueError(f"the t-interval here is over 3 seeds, got {len(values)} values")
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = t_quantile_2dof(1 - (1 - level) / 2) * sd / math.sqrt(len(values))
    return mean - half, mean + half


def sign_test_p(values: list[float]) -> float:
    """One-sided sign test: P(at least as many values on the side of the majority) under a
    fair coin, counting zeros against it."""
    n = len(values)
    k = max(sum(v > 0 for v in values), sum(v < 0 for v in values))
    return sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n


def paired_se(diffs: list[float]) -> float:
    """Standard error of the mean of per-prompt differences."""
    return statistics.stdev(diffs) / math.sqrt(len(diffs))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct of n samples: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_table(samples: list[dict]) -> dict:
    """What a policy's kept samples (`study4_eval.sample_records`) say: pass@k for every k the
    samples allow, the fraction cut at the cap, pass@1 among the uncut samples, how the answers
    were found, mean response tokens, and pass@1 per stratum."""
    by_prompt: dict[str, list[dict]] = {}
    for s in samples:
        by_prompt.setdefault(s["uid"], []).append(s)
    n = min(len(v) for v in by_prompt.values())
    uncut = [s for s in samples if not s["truncated"]]
    table = {
        f"pass@{k}": statistics.fmean(
            pass_at_k(len(v), sum(s["correct"] for s in v), k) for v in by_prompt.values()
        )
        for k in range(1, n + 1)
    }
    table["truncated"] = statistics.fmean(s["truncated"] for s in samples)
    table["pass@1 uncut"] = statistics.fmean(s["correct"] for s in uncut) if uncut else math.nan
    table["pass@1 of cut"] = (
        statistics.fmean(s["correct"] for s in samples if s["truncated"])
        if len(uncut) < len(samples)
        else math.nan
    )
    found = Counter(s["found_by"] or "none" for s in samples)
    table["found_by"] = {k: v / len(samples) for k, v in sorted(found.items())}
    table["mean_tokens"] = statistics.fmean(s["response_tokens"] for s in samples)
    strata: dict[str, list[bool]] = {}
    for s in samples:
        strata.setdefault(s.get("stratum", "all"), []).append(s["correct"])
    table["by_stratum"] = {k: (len(v), statistics.fmean(v)) for k, v in sorted(strata.items())}
    return table


def verdict(d: list[float]) -> dict:
    """The pre-registered rule on d, CA-GRPO minus GRPO in test2 pass@1 at T=0.7, one value per
    seed (three seeds):

    - supports the paper:    mean d >= +DELTA and d > 0 in every seed;
    - contradicts the paper: mean d <= -DELTA and d < 0 in every seed;
    - otherwise inconclusive.

    The two need the same evidence, mirrored. Reported beside the label whatever it is: the
    95% t-interval of mean d over the seeds (2 dof) and whether it excludes 0, and the
    one-sided sign test's p."""
    mean = statistics.fmean(d)
    low, high = t_interval(d)
    if mean >= DELTA and all(x > 0 for x in d):
        label = "supports the paper"
    elif mean <= -DELTA and all(x < 0 for x in d):
        label = "contradicts the paper"
    else:
        label = "inconclusive"
    return {
        "label": label, "d": d, "mean_d": mean, "t95": [low, high],
        "t95_excludes_0": low > 0 or high < 0, "sign_test_p": sign_test_p(d),
    }  # fmt: skip
