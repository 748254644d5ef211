"""Round 3's statistics beside its pre-registered verdict, from what `docs/results/evidence3/kept/`
holds; no model runs. Prints the tables of `docs/results/evidence3.md` section 6:

    PYTHONPATH=$PWD .venv/bin/python experiments/evidence3_stats.py

What the kept test results hold: per run and setting (T=0.7 with 4 samples a prompt, greedy with
one), the aggregate metrics (pass@1, pass@2, pass@4, maj@4, mean response tokens, the fraction of
responses cut at the 200-token cap) and, per prompt, its uid and number of correct samples.
Not kept: the responses, their lengths, finish reasons and extracted answers per sample, so
which responses were cut, and whether a cut one scored, cannot be read back (section 6 says
what that leaves open).

- Seeds: d_s = CA-GRPO minus GRPO in test pass@1 at T=0.7, seed s; the t-interval of mean d
  over the three seeds, mean +- t(0.975, 2) * sd / sqrt(3), with t(0.975, 2) = 4.3027 exactly
  (for 2 degrees of freedom the t quantile is (2p - 1) / sqrt(2 p (1 - p))); the one-sided sign
  test (3 of 3 negative: 0.5^3); each seed's paired standard error over the 256 prompts,
  sd_i(d_i) / sqrt(256), d_i = the prompt's difference in fraction correct.
- pass@k for k = 1..n (n samples a prompt): the unbiased estimator 1 - C(n - c, k) / C(n, k),
  averaged over prompts (`cagrpo_ray.eval.metrics.pass_at_k`).
- Question forms: the test prompts are rebuilt from the split's definition (the same source as
  the runs: seed 0, the eval seed region, training questions of the 20,000-prompt train split
  excluded, items 64-319), and each question's expression is reduced to its form: numbers to
  `n`, the operator to `op` (e.g. `-( ( n op n ) )`). Training prompts: the 240 the runs trained
  on (train items 0-239: 60 steps x 4 prompts, the same for every run; `data/cursor` is 240 at
  step 60) and the whole 20,000-prompt training split.
- Truncation: the kept fraction cut at the cap, and pass@1 with cut responses counted as
  missing, p / (1 - t): exact if every cut response scored 0 (a response cut before its
  `Answer:` line has none to score), an upper bound otherwise.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from study4_plan import coarse_form, form, pass_at_k, t_quantile_2dof

REPO = Path(__file__).resolve().parents[1]
KEPT = REPO / "docs/results/evidence3/kept"
SEEDS = (1, 2, 3)
CHOSEN_LR = "1e-5"  # both methods' lr by the rule (evidence3.md section 5)
TRAINED_PROMPTS = 240  # 60 steps x 4 prompts, train items 0..239 in order
VALIDATION_SIZE, TEST_SIZE, TRAIN_SIZE = 64, 256, 20_000
DATASET_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
LABELS = {"plain": "plain", "negated": "with -( )", "parenthesised": "parenthesised, no -( )"}


def coarse(form_: str) -> str:
    """Three classes: plain `n op n`, parenthesised without a negated group, with one."""
    return LABELS[coarse_form(form_)]


def run_name(method: str, seed: int) -> str:
    return f"{'grid' if seed == 1 else 'seeds'}-{method}-lr{CHOSEN_LR}-s{seed}"


def load(name: str, setting: str) -> dict:
    return json.loads((KEPT / "test" / f"{name}-{setting}.json").read_text())


def correct_fractions(result: dict) -> dict[str, float]:
    """{uid: fraction of the prompt's samples scored correct}."""
    n = result["metrics"]["samples"]
    return {p["uid"]: p["num_correct"] / n for p in result["per_prompt"]}


def prompts() -> tuple[dict[str, str], list[str], list[str]]:
    """({test uid: form}, forms of the 240 trained prompts, forms of the 20,000 train prompts)."""
    from cagrpo_ray.data import ReasoningGymSource

    held_out = ReasoningGymSource(
        "basic_arithmetic", DATASET_CONFIG, seed=0, size=VALIDATION_SIZE + TEST_SIZE,
        split="eval", exclude_sizes={"train": TRAIN_SIZE},
    )  # fmt: skip
    items = list(held_out.iter_from(VALIDATION_SIZE))
    test = {item.uid: form(item.metadata["expression"]) for item in items}
    train = ReasoningGymSource("basic_arithmetic", DATASET_CONFIG, seed=0, size=TRAIN_SIZE)
    train_forms = [form(item.metadata["expression"]) for item in train.iter_from(0)]
    return test, train_forms[:TRAINED_PROMPTS], train_forms


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def seed_table() -> dict:
    print("## Seeds: d = CA-GRPO - GRPO, test pass@1 (256 prompts)\n")
    print("| setting | seed | GRPO | CA-GRPO | d | paired SE over prompts | d / SE |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for setting in ("T0.7", "T0"):
        ds = []
        for seed in SEEDS:
            g = correct_fractions(load(run_name("grpo", seed), setting))
            c = correct_fractions(load(run_name("cagrpo", seed), setting))
            diffs = [c[u] - g[u] for u in g]
            d = mean(diffs)
            se = statistics.stdev(diffs) / math.sqrt(len(diffs))
            ds.append(d)
            print(f"| {setting} | {seed} | {mean(g.values()):.3f} | {mean(c.values()):.3f} | "
                  f"{d:+.3f} | {se:.3f} | {d / se:+.1f} |")  # fmt: skip
        m, sd = mean(ds), statistics.stdev(ds)
        t = t_quantile_2dof(0.975)
        low, high = m - t * sd / math.sqrt(3), m + t * sd / math.sqrt(3)
        negative = sum(d < 0 for d in ds)
        sign_p = sum(math.comb(3, j) for j in range(negative, 4)) / 8
        out[setting] = {"d": ds, "mean": m, "sd": sd, "t95": (low, high), "sign_p": sign_p}
        print(f"| {setting} | mean | | | {m:+.3f} | seed sd {sd:.3f} | t 95% [{low:+.3f}, "
              f"{high:+.3f}] (t(0.975, 2) = {t:.4f}); {negative} of 3 negative, one-sided "
              f"sign test p = {sign_p:.3f} |")  # fmt: skip
    print()
    return out


def pass_k_table() -> None:
    print("## pass@k on the test split (T=0.7, 4 samples; greedy has pass@1 only)\n")
    print("| policy | pass@1 | pass@2 | pass@3 | pass@4 | maj@4 |")
    print("|---|---|---|---|---|---|")
    names = ["start"] + [run_name(m, s) for m in ("grpo", "cagrpo") for s in SEEDS]
    for name in names:
        result = load(name, "T0.7")
        n = result["metrics"]["samples"]
        cells = [
            mean(pass_at_k(n, p["num_correct"], k) for p in result["per_prompt"])
            for k in range(1, n + 1)
        ]
        stored = [result["metrics"][f"pass@{k}"] for k in (1, 2, 4)]
        if any(abs(a - b) > 1e-12 for a, b in zip(stored, cells[0:2] + cells[3:], strict=True)):
            raise SystemExit(f"{name}: pass@k recomputed {cells} != stored {stored}")
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in cells)
              + f" | {result['metrics']['maj@4']:.3f} |")  # fmt: skip
    for k in range(1, 5):
        ds = []
        for seed in SEEDS:
            by = {}
            for m in ("grpo", "cagrpo"):
                result = load(run_name(m, seed), "T0.7")
                by[m] = mean(pass_at_k(4, p["num_correct"], k) for p in result["per_prompt"])
            ds.append(by["cagrpo"] - by["grpo"])
        print(f"\npass@{k}: d by seed " + ", ".join(f"{d:+.3f}" for d in ds)
              + f"; mean {mean(ds):+.3f}")  # fmt: skip
    print()


def truncation_table() -> None:
    print("## Truncation at the 200-token cap, and pass@1 with cut responses counted missing\n")
    print("| policy | T=0.7: cut | pass@1 | p/(1-cut) | mean tokens | greedy: cut | pass@1 | "
          "p/(1-cut) | mean tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    names = ["start"] + [run_name(m, s) for m in ("grpo", "cagrpo") for s in SEEDS]
    adjusted: dict = {}
    for name in names:
        cells = []
        for setting in ("T0.7", "T0"):
            m = load(name, setting)["metrics"]
            cut, p = m["truncated_fraction"], m["pass@1"]
            adjusted[(name, setting)] = p / (1 - cut)
            cells += [f"{cut:.3f}", f"{p:.3f}", f"{p / (1 - cut):.3f}",
                      f"{m['mean_response_tokens']:.0f}"]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")
    for setting in ("T0.7", "T0"):
        ds = [
            adjusted[(run_name("cagrpo", s), setting)] - adjusted[(run_name("grpo", s), setting)]
            for s in SEEDS
        ]
        print(f"\n{setting}, cut responses counted missing: d by seed "
              + ", ".join(f"{d:+.3f}" for d in ds) + f"; mean {mean(ds):+.3f}")  # fmt: skip
    print()


def form_tables() -> None:
    test, trained, pool = prompts()
    print("## Question forms: test split against training prompts\n")
    print("| form | test prompts (256) | trained prompts (240) | training split (20,000) |")
    print("|---|---|---|---|")
    for classes, label in ((coarse, "coarse"), (lambda f: f, "fine")):
        t = Counter(classes(f) for f in test.values())
        a = Counter(classes(f) for f in trained)
        b = Counter(classes(f) for f in pool)
        common = {k for k in b if b[k] >= 200} if label == "fine" else set(b)
        keys = sorted(set(t) | set(a) | common, key=lambda k: (-b[k], k))
        for k in keys:
            print(f"| {k} | {t[k]} ({t[k] / 256:.0%}) | {a[k]} ({a[k] / 240:.0%}) | "
                  f"{b[k]} ({b[k] / len(pool):.0%}) |")  # fmt: skip
        if label == "coarse":
            print("| *fine forms:* | | | |")
    print("\n(fine forms listed: those in the test or trained prompts, or >= 200 of the split)\n")
    print("## Test pass@1 by coarse form (mean over the three seeds; per seed in brackets)\n")
    print("| form | prompts | setting | start | GRPO | CA-GRPO | d (per seed) |")
    print("|---|---|---|---|---|---|---|")
    for cls in sorted({coarse(f) for f in test.values()}):
        uids = [u for u, f in test.items() if coarse(f) == cls]
        for setting in ("T0.7", "T0"):
            start = correct_fractions(load("start", setting))
            by = {
                m: [mean(correct_fractions(load(run_name(m, s), setting))[u] for u in uids)
                    for s in SEEDS]
                for m in ("grpo", "cagrpo")
            }  # fmt: skip
            ds = [c - g for c, g in zip(by["cagrpo"], by["grpo"], strict=True)]
            print(f"| {cls} | {len(uids)} | {setting} | {mean(start[u] for u in uids):.3f} | "
                  f"{mean(by['grpo']):.3f} | {mean(by['cagrpo']):.3f} | {mean(ds):+.3f} ("
                  + ", ".join(f"{d:+.3f}" for d in ds) + ") |")  # fmt: skip
    print()


def main() -> int:
    seed_table()
    pass_k_table()
    truncation_table()
    form_tables()
    return 0


if __name__ == "__main__":
    sys.exit(main())
