"""The evidence study's markdown tables, each computed from the finished runs alone.

Every function returns one markdown block (a table, or a list of facts) for the results page;
`study_page.py` decides where each goes.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from study_results import EARLY, Loaded, by_method, checkpoints, finite, fmt, mean_std

from cagrpo_ray.metrics.provenance import markdown_table

COV_FRACTIONS = ("0.01pct", "1pct", "20pct", "40pct")
COV_KEYS = [f"cov/pos_{f}" for f in COV_FRACTIONS] + [f"cov/neg_{f}" for f in COV_FRACTIONS]
COV_NAMES = [f"top {f.replace('pct', '%')}" for f in COV_FRACTIONS] + [
    f"bottom {f.replace('pct', '%')}" for f in COV_FRACTIONS
]
WEIGHT_KEYS = (
    "cagrpo/weight_min",
    "cagrpo/weight_p01",
    "cagrpo/weight_mean",
    "cagrpo/weight_max",
    "cagrpo/weight_frac_below_0.5",
    "cagrpo/sigma_mean",
    "cagrpo/degenerate_frac",
)
# Per-step keys that measure time, not learning: excluded from the GRPO == CA-GRPO(ones) check.
TIMING_PREFIXES = ("time/", "throughput/", "sync/seconds", "generators/idle_fraction")
# Listed when two runs agree on every metric, to show that the comparison was made.
SHOWN_WHEN_EQUAL = ("entropy/mean", "loss/total", "learner/grad_norm", "reward/mean")


def heldout_table(groups: dict[str, list[Loaded]], metric: str) -> str:
    """A held-out metric by method (rows) and checkpoint (columns), mean ± std over seeds."""
    steps = sorted({s for items in groups.values() for s in checkpoints(items)})
    rows = [
        [f"{method} (n={len(items)})", *(fmt([it.at(s, metric) for it in items]) for s in steps)]
        for method, items in groups.items()
    ]
    return markdown_table(["method", *(f"step {s}" for s in steps)], rows)


def paired_delta_table(groups: dict[str, list[Loaded]], metric: str, base: str = "grpo") -> str:
    """Method minus GRPO of the same seed (same prompts, same sampling seeds), mean ± std."""
    if base not in groups:
        return "(no GRPO runs)"
    base_by_seed = {it.run.seed: it for it in groups[base]}
    steps = checkpoints(groups[base])[1:]
    last = steps[-1] if steps else 0
    rows = []
    for method, items in groups.items():
        if method == base:
            continue
        pairs = [(it, base_by_seed[it.run.seed]) for it in items if it.run.seed in base_by_seed]
        cells = [fmt([a.at(s, metric) - b.at(s, metric) for a, b in pairs]) for s in steps]
        per_seed = ", ".join(
            f"s{a.run.seed}: {a.at(last, metric) - b.at(last, metric):+.3f}" for a, b in pairs
        )
        rows.append([method, *cells, per_seed])
    headers = [f"method − {base}", *(f"step {s}" for s in steps), "per seed (last)"]
    return markdown_table(headers, rows)


def trajectory_table(groups: dict[str, list[Loaded]], keys: list[tuple[str, str]]) -> str:
    """Early- and late-window means (mean ± std over seeds) of per-step metrics; `keys` holds
    (metric, column label) pairs."""
    headers = ["method"] + [f"{label} {which}" for _, label in keys for which in ("early", "late")]
    rows = [
        [method]
        + [
            fmt([it.window(key, which) for it in items])
            for key, _ in keys
            for which in ("early", "late")
        ]
        for method, items in groups.items()
    ]
    return markdown_table(headers, rows)


def window_table(
    groups: dict[str, list[Loaded]], keys, names, spec: str, label: str = "method"
) -> str:
    """Per-step metrics `keys` (columns headed `names`) averaged over the early or late window
    and then over the runs of each group, formatted with `spec`; two rows per group.

    The paper's covariance table is this with the COV_KEYS quantile thresholds by method; the
    kernel-weight table is this with WEIGHT_KEYS and one group per run."""
    rows = [
        [
            name,
            which,
            *(f"{mean_std([it.window(k, which) for it in items])[0]:{spec}}" for k in keys),
        ]
        for name, items in groups.items()
        for which in ("early", "late")
    ]
    return markdown_table([label, "steps", *names], rows)


def entropy_shape_table(groups: dict[str, list[Loaded]]) -> str:
    """Per run: entropy at the start, its minimum, its end, and whether it fell then rose."""
    rows = []
    for items in groups.values():
        for it in items:
            steps, ent = it.series("entropy/mean")
            if not ent:
                continue
            i_min, i_max = ent.index(min(ent)), ent.index(max(ent))
            early, late = it.window("entropy/mean", "early"), it.window("entropy/mean", "late")
            rows.append(
                [
                    it.run.name,
                    f"{early:.4f}",
                    f"{ent[i_min]:.4f} ({steps[i_min]})",
                    f"{ent[i_max]:.4f} ({steps[i_max]})",
                    f"{late:.4f}",
                    f"{late / early:.2f}",
                ]
            )
    headers = ["run", f"first {EARLY} steps", "min (step)", "max (step)", f"last {EARLY} steps"]
    return markdown_table([*headers, "last/first"], rows)


def compare_runs(a: Loaded, b: Loaded) -> tuple[str, str]:
    """Step-by-step comparison of two runs that should train identically; (verdict, table).

    Timing metrics and CA-GRPO's own `cagrpo/*` diagnostics (absent from GRPO) are excluded."""
    keys = sorted(
        ({k for r in a.records for k in r} & {k for r in b.records for k in r}) - {"step"}
    )
    keys = [k for k in keys if not k.startswith(TIMING_PREFIXES) and not k.startswith("cagrpo/")]
    rows, differing = [], []
    for key in keys:
        _, va = a.series(key)
        _, vb = b.series(key)
        n = min(len(va), len(vb))
        diffs = [abs(x - y) for x, y in zip(va[:n], vb[:n], strict=True)]
        first = next((i + 1 for i, d in enumerate(diffs) if d != 0.0), None)
        if first is not None:
            differing.append(key)
        rows.append((key, max(diffs) if diffs else 0.0, first))
    ha, hb = a.heldout(), b.heldout()
    evals_equal = all(ha[s].get("pass@1") == hb.get(s, {}).get("pass@1") for s in ha)
    shown = [r for r in rows if r[2] is not None] or [r for r in rows if r[0] in SHOWN_WHEN_EQUAL]
    table = markdown_table(
        ["metric", "max abs difference", "first differing step"],
        [[k, f"{d:.3g}", f if f is not None else "–"] for k, d, f in shown],
    )
    if not differing and evals_equal:
        verdict = (
            f"bit-for-bit identical: all {len(keys)} compared per-step metrics over "
            f"{len(a.records)} steps and all held-out evals are equal"
        )
    else:
        verdict = (
            f"{len(differing)} of {len(keys)} per-step metrics differ "
            f"(held-out evals {'equal' if evals_equal else 'differ'})"
        )
    return verdict, table


def identity_checks(loaded: dict[str, Loaded]) -> list[tuple[str, str, str]]:
    """(title, verdict, table) for every pair that must train identically: GRPO vs CA-GRPO with
    its kernel frozen at 1, and GRPO vs KL-Cov of the same seed (ratio 1 on the one on-policy
    step, so KL-Cov's |log r| penalty has zero gradient)."""
    pairs = []
    ones = {it.run.method: it for it in loaded.values() if it.run.group == "ones-check"}
    if "grpo" in ones and "cagrpo_ones" in ones:
        pairs.append(
            ("GRPO vs CA-GRPO with `cagrpo_kernel=ones`", ones["grpo"], ones["cagrpo_ones"])
        )
    main = by_method(loaded, "main")
    grpo = {it.run.seed: it for it in main.get("grpo", [])}
    for it in main.get("kl_cov", []):
        if it.run.seed in grpo:
            pairs.append((f"GRPO vs KL-Cov, main grid seed {it.run.seed}", grpo[it.run.seed], it))
    return [(title, *compare_runs(a, b)) for title, a, b in pairs]


def anatomy_section(out: Path) -> str:
    """Tables from experiments/kernel_anatomy.py's analysis of a few batches, when it has run."""
    path = out / "anatomy.json"
    if not path.exists():
        return "_(not run)_"
    a = json.loads(path.read_text())
    cfg, batches = a["config"], a["batches"]
    batch_table = markdown_table(
        ["batch seed", "responses", "tokens", "accuracy", "equal-reward groups", "entropy"],
        [
            [b["seed"], x["responses"], x["tokens"], f"{x['accuracy']:.3f}"]
            + [f"{x['equal_reward_groups']:.2f}", f"{x['entropy']:.4f}"]
            for b in batches
            for x in [b["batch"]]
        ],
    )
    token_keys = ("share_of_tokens", "mean_logp", "mean_abs_advantage")
    token_keys += ("share_in_correct_responses", "share_with_positive_advantage")
    token_table = markdown_table(
        ["batch seed", "tokens", "count", "share", "mean log π", "mean abs(A)"]
        + ["in correct responses", "with A > 0"],
        [
            [b["seed"], key, d["tokens"], *(f"{d[k]:.3f}" for k in token_keys)]
            for b in batches
            for key, d in b["tokens"].items()
            if d.get("tokens")
        ],
    )
    gradient_table = markdown_table(
        ["batch seed", "gradient of", "norm", "cosine to GRPO's", "Δ entropy"]
        + ["Δ log-lik. of correct responses", "Δ log-lik. of incorrect responses"],
        [
            [b["seed"], name, f"{g['norm']:.4f}", f"{g['cosine_to_grpo']:.3f}"]
            + [f"{g['entropy_change_after_one_adam_step']:+.5f}"]
            + [f"{g['loglik_correct_change']:+.4f}", f"{g['loglik_incorrect_change']:+.4f}"]
            for b in batches
            for name, g in b["gradients"].items()
        ],
    )
    command = (
        f"Command: `flock /tmp/cagrpo-cpu.lock .venv/bin/python experiments/kernel_anatomy.py "
        f"--out {path}` (defaults: {cfg['prompts']} training prompts × {cfg['group_size']} per "
        f"batch, batches with seeds {cfg['seeds']}, step lr {cfg['lr']:g}), on the pinned source."
    )
    return "\n\n".join(
        [
            command,
            batch_table,
            "Which tokens the kernel down-weights (w~ < 0.5), split by the sign of their "
            "covariance c:",
            token_table,
            "What one Adam step along each gradient does on the same batch:",
            gradient_table,
        ]
    )


def regime_facts(loaded: dict[str, Loaded]) -> str:
    """Facts about the training regime that the discussion relies on, computed over all runs."""
    values = {
        k: [float(r[k]) for it in loaded.values() for r in it.records if finite(r.get(k))]
        for k in (
            "policy/ratio_max",
            "policy/ratio_mean",
            "policy/clip_frac",
            "policy/approx_kl",
            "learner/tokens",
        )
    }
    if not values["policy/ratio_max"]:
        return "_(no runs)_"
    lines = [
        f"* Over all {sum(len(it.records) for it in loaded.values())} learner steps of all "
        f"{len(loaded)} runs: largest `policy/ratio_max` {max(values['policy/ratio_max']):.6g}, "
        f"smallest `policy/ratio_mean` {min(values['policy/ratio_mean']):.6g}, largest "
        f"`policy/clip_frac` {max(values['policy/clip_frac']):.3g}, largest `policy/approx_kl` "
        f"{max(values['policy/approx_kl']):.3g}: one on-policy optimizer step per batch, so the "
        "ratio is 1 and PPO clipping never binds.",
        f"* Tokens per learner step: {statistics.fmean(values['learner/tokens']):.0f} on average "
        f"(min {min(values['learner/tokens']):.0f}, max {max(values['learner/tokens']):.0f}).",
    ]
    for method, key in (("clip_cov", "clip_cov/selected_frac"), ("kl_cov", "kl_cov/selected_frac")):
        sel = [
            float(r[key]) * float(r["learner/tokens"])
            for it in loaded.values()
            if it.run.method == method
            for r in it.records
            if finite(r.get(key))
        ]
        if sel:
            lines.append(
                f"* `{method}`: tokens selected per step, mean {statistics.fmean(sel):.2f} "
                f"(min {min(sel):.0f}, max {max(sel):.0f})."
            )
    return "\n".join(lines)


def provenance_table(loaded: dict[str, Loaded]) -> str:
    """Every run with its recorded start, wall time, exit code, source commit and command."""
    rows = []
    for it in loaded.values():
        p = it.provenance
        cmd = p.get("command", "(no provenance recorded)").replace("|", "\\|")
        rows.append(
            [it.run.name, it.run.group, p.get("started_utc", "?"), p.get("wall_s") or "?"]
            + [p.get("returncode", "?"), str(p.get("source_commit", "?"))[:10], f"`{cmd}`"]
        )
    headers = ["run", "group", "started (UTC)", "wall s", "rc", "commit", "command"]
    return markdown_table(headers, rows)
