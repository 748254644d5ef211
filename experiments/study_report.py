"""Aggregation half of the evidence study: tables, plots and the markdown page.

Reads `<out>/<run>/metrics.jsonl`, `summary.json` and `provenance.json` of the runs that
`study.py` planned, and writes `docs/results/evidence.md` with PNGs next to it. Nothing here
trains; `study.py --aggregate-only` calls only this.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COV_FRACTIONS = ("0.01pct", "1pct", "20pct", "40pct")
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
EARLY = 10  # steps 1..EARLY form the "early" window, the last EARLY steps the "late" one
COLORS = {
    "grpo": "C0",
    "clip_cov": "C1",
    "kl_cov": "C2",
    "cagrpo": "C3",
    "cagrpo_batch": "C4",
    "cagrpo_unnorm": "C5",
    "cagrpo_ones": "C6",
}
DISCUSSION = Path(__file__).resolve().parent / "evidence_discussion.md"
ENTROPY_KEYS = [("entropy/mean", "entropy"), ("accuracy/train", "train acc")]
GRAD_KEY = ("learner/grad_norm", "grad norm")


@dataclass
class Loaded:
    """One finished run as read from disk."""

    run: object  # study.Run
    records: list[dict]
    summary: dict
    provenance: dict | None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        pts = [(r["step"], float(r[key])) for r in self.records if _finite(r.get(key))]
        return [p[0] for p in pts], [p[1] for p in pts]

    def window(self, key: str, which: str) -> float:
        """Mean of `key` over the early (first EARLY) or late (last EARLY) steps."""
        _, values = self.series(key)
        if not values:
            return math.nan
        part = values[:EARLY] if which == "early" else values[-EARLY:]
        return sum(part) / len(part)

    def heldout(self) -> dict[int, dict]:
        """Held-out eval results by step: 0 (before), every eval_every step, and the final."""
        out = {0: self.summary["eval_before"]} if "eval_before" in self.summary else {}
        for r in self.records:
            if _finite(r.get("eval/pass@1")):
                out[r["step"]] = {
                    k[len("eval/") :]: v for k, v in r.items() if k.startswith("eval/")
                }
        if "eval_after" in self.summary:
            out[self.summary["final_step"]] = self.summary["eval_after"]
        return out


def _finite(v) -> bool:
    return isinstance(v, int | float) and math.isfinite(float(v))


def load(runs, out: Path) -> dict[str, Loaded]:
    """The runs whose summary exists, by name (unfinished ones are reported as missing)."""
    loaded = {}
    for run in runs:
        d = out / run.name
        if not (d / "summary.json").exists():
            continue
        records = [
            json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
        prov = (
            json.loads((d / "provenance.json").read_text())
            if (d / "provenance.json").exists()
            else None
        )
        loaded[run.name] = Loaded(run, records, json.loads((d / "summary.json").read_text()), prov)
    return loaded


# ----------------------------------------------------------------------------- statistics


def _at(item: Loaded, step: int, metric: str) -> float:
    """A held-out metric of a run at one checkpoint (NaN when it was not evaluated there)."""
    return item.heldout().get(step, {}).get(metric, math.nan)


def mean_std(values: list[float]) -> tuple[float, float, int]:
    values = [v for v in values if _finite(v)]
    if not values:
        return math.nan, math.nan, 0
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return statistics.fmean(values), sd, len(values)


def fmt(values: list[float], digits: int = 3) -> str:
    m, s, n = mean_std(values)
    if n == 0:
        return "–"
    if n == 1:
        return f"{m:.{digits}f} (n=1)"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def eval_se(p: float, num_prompts: int, samples: int) -> float:
    """Binomial standard error of a pass@1 estimate from num_prompts x samples draws, a lower
    bound of the true one (samples of one prompt are correlated)."""
    return math.sqrt(max(p * (1 - p), 1e-12) / (num_prompts * samples))


# ----------------------------------------------------------------------------- tables


def by_method(loaded: dict[str, Loaded], group: str) -> dict[str, list[Loaded]]:
    out: dict[str, list[Loaded]] = {}
    for item in loaded.values():
        if item.run.group == group:
            out.setdefault(item.run.method, []).append(item)
    for items in out.values():
        items.sort(key=lambda x: x.run.seed)
    return out


def checkpoints(items: list[Loaded]) -> list[int]:
    steps = sorted({s for it in items for s in it.heldout()})
    return steps


def heldout_table(groups: dict[str, list[Loaded]], metric: str) -> str:
    steps = sorted({s for items in groups.values() for s in checkpoints(items)})
    lines = [
        "| method | " + " | ".join(f"step {s}" for s in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    for method, items in groups.items():
        cells = [fmt([_at(it, s, metric) for it in items]) for s in steps]
        lines.append(f"| {method} (n={len(items)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_delta_table(groups: dict[str, list[Loaded]], metric: str, base: str = "grpo") -> str:
    """Method minus GRPO of the same seed (same prompts, same sampling seeds), mean ± std."""
    if base not in groups:
        return "(no GRPO runs)"
    base_by_seed = {it.run.seed: it for it in groups[base]}
    steps = checkpoints(groups[base])[1:]
    lines = [
        "| method − grpo | " + " | ".join(f"step {s}" for s in steps) + " | per seed (last) |",
        "|---|" + "---|" * (len(steps) + 1),
    ]
    for method, items in groups.items():
        if method == base:
            continue
        pairs = [(it, base_by_seed[it.run.seed]) for it in items if it.run.seed in base_by_seed]
        cells = []
        for s in steps:
            d = [_at(a, s, metric) - _at(b, s, metric) for a, b in pairs]
            cells.append(fmt(d))
        last = steps[-1] if steps else 0
        per_seed = ", ".join(
            f"s{a.run.seed}: {_at(a, last, metric) - _at(b, last, metric):+.3f}" for a, b in pairs
        )
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {per_seed} |")
    return "\n".join(lines)


def trajectory_table(groups: dict[str, list[Loaded]], keys: list[tuple[str, str]]) -> str:
    """Early- and late-window means (mean ± std over seeds) of per-step metrics."""
    head = " | ".join(f"{label} early | {label} late" for _, label in keys)
    lines = [f"| method | {head} |", "|---|" + "---|" * (2 * len(keys))]
    for method, items in groups.items():
        cells = []
        for key, _ in keys:
            cells += [
                fmt([it.window(key, "early") for it in items]),
                fmt([it.window(key, "late") for it in items]),
            ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def entropy_shape_table(groups: dict[str, list[Loaded]]) -> str:
    """Per run: entropy at the start, its minimum, its end, and whether it fell then rose."""
    lines = [
        "| run | first 10 steps | min (step) | max (step) | last 10 steps | last/first |",
        "|---|---|---|---|---|---|",
    ]
    for items in groups.values():
        for it in items:
            steps, ent = it.series("entropy/mean")
            if not ent:
                continue
            i_min, i_max = ent.index(min(ent)), ent.index(max(ent))
            early, late = it.window("entropy/mean", "early"), it.window("entropy/mean", "late")
            lines.append(
                f"| {it.run.name} | {early:.4f} | {ent[i_min]:.4f} ({steps[i_min]}) | "
                f"{ent[i_max]:.4f} ({steps[i_max]}) | {late:.4f} | {late / early:.2f} |"
            )
    return "\n".join(lines)


def covariance_table(groups: dict[str, list[Loaded]]) -> str:
    """The paper's covariance table: thresholds of the top / bottom 0.01%, 1%, 20%, 40% of
    token covariances, averaged over the early or late steps and over seeds."""
    cols = [f"pos_{f}" for f in COV_FRACTIONS] + [f"neg_{f}" for f in COV_FRACTIONS]
    names = [f"top {f.replace('pct', '%')}" for f in COV_FRACTIONS] + [
        f"bottom {f.replace('pct', '%')}" for f in COV_FRACTIONS
    ]
    lines = ["| method | steps | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(cols)]
    for method, items in groups.items():
        for which in ("early", "late"):
            cells = []
            for c in cols:
                m, _, _ = mean_std([it.window(f"cov/{c}", which) for it in items])
                cells.append(f"{m:+.3g}")
            lines.append(f"| {method} | {which} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kernel_table(items: list[Loaded]) -> str:
    lines = [
        "| run | steps | " + " | ".join(k.split("/")[1] for k in WEIGHT_KEYS) + " |",
        "|---|---|" + "---|" * len(WEIGHT_KEYS),
    ]
    for it in items:
        for which in ("early", "late"):
            cells = [f"{it.window(k, which):.4g}" for k in WEIGHT_KEYS]
            lines.append(f"| {it.run.name} | {which} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    table = ["| metric | max abs difference | first differing step |", "|---|---|---|"]
    shown = [r for r in rows if r[2] is not None] or [r for r in rows if r[0] in SHOWN_WHEN_EQUAL]
    table += [f"| {k} | {d:.3g} | {f if f is not None else '–'} |" for k, d, f in shown]
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
    return verdict, "\n".join(table)


SHOWN_WHEN_EQUAL = ("entropy/mean", "loss/total", "learner/grad_norm", "reward/mean")


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
    cfg = a["config"]
    lines = [
        f"Command: `flock /tmp/cagrpo-cpu.lock .venv/bin/python experiments/kernel_anatomy.py "
        f"--out {path}` (defaults: {cfg['prompts']} training prompts × {cfg['group_size']} per "
        f"batch, batches with seeds {cfg['seeds']}, step lr {cfg['lr']:g}), on the pinned source.",
        "",
        "| batch seed | responses | tokens | accuracy | equal-reward groups | entropy |",
        "|---|---|---|---|---|---|",
    ]
    for b in a["batches"]:
        x = b["batch"]
        lines.append(
            f"| {b['seed']} | {x['responses']} | {x['tokens']} | {x['accuracy']:.3f} | "
            f"{x['equal_reward_groups']:.2f} | {x['entropy']:.4f} |"
        )
    lines += [
        "",
        "Which tokens the kernel down-weights (w~ < 0.5), split by the sign of their covariance c:",
        "",
        "| batch seed | tokens | count | share | mean log π | mean abs(A) "
        "| in correct responses | with A > 0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in a["batches"]:
        for key, d in b["tokens"].items():
            if d.get("tokens"):
                lines.append(
                    f"| {b['seed']} | {key} | {d['tokens']} | {d['share_of_tokens']:.3f} | "
                    f"{d['mean_logp']:.3f} | {d['mean_abs_advantage']:.3f} | "
                    f"{d['share_in_correct_responses']:.3f} | "
                    f"{d['share_with_positive_advantage']:.3f} |"
                )
    lines += [
        "",
        "What one Adam step along each gradient does on the same batch:",
        "",
        "| batch seed | gradient of | norm | cosine to GRPO's | Δ entropy | "
        "Δ log-lik. of correct responses | Δ log-lik. of incorrect responses |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in a["batches"]:
        for name, g in b["gradients"].items():
            lines.append(
                f"| {b['seed']} | {name} | {g['norm']:.4f} | {g['cosine_to_grpo']:.3f} | "
                f"{g['entropy_change_after_one_adam_step']:+.5f} | "
                f"{g['loglik_correct_change']:+.4f} | "
                f"{g['loglik_incorrect_change']:+.4f} |"
            )
    return "\n".join(lines)


def regime_facts(loaded: dict[str, Loaded]) -> str:
    """Facts about the training regime that the discussion relies on, computed over all runs."""
    values = {
        k: [float(r[k]) for it in loaded.values() for r in it.records if _finite(r.get(k))]
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
            if _finite(r.get(key))
        ]
        if sel:
            lines.append(
                f"* `{method}`: tokens selected per step, mean {statistics.fmean(sel):.2f} "
                f"(min {min(sel):.0f}, max {max(sel):.0f})."
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots


def _mean_curve(items: list[Loaded], key: str, smooth: int = 1) -> tuple[list[int], list[float]]:
    per = [dict(zip(*it.series(key), strict=True)) for it in items]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    mean = [statistics.fmean(p[s] for p in per) for s in steps]
    if smooth > 1:
        mean = [statistics.fmean(mean[max(0, i - smooth + 1) : i + 1]) for i in range(len(mean))]
    return steps, mean


def plot_curves(groups, key, title, ylabel, path: Path, smooth: int = 1, logy: bool = False):
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heldout(groups, path: Path):
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("pass@1", "pass@4"), strict=True):
        for i, (method, items) in enumerate(groups.items()):
            steps = checkpoints(items)
            stats = [mean_std([_at(it, s, metric) for it in items]) for s in steps]
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_covariance(groups, path: Path):
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kernel(items: list[Loaded], path: Path):
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- page


def provenance_rows(loaded: dict[str, Loaded]) -> str:
    lines = [
        "| run | group | started (UTC) | wall s | rc | commit | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for it in loaded.values():
        p = it.provenance or {}
        cmd = p.get("command", "(no provenance recorded)").replace("|", "\\|")
        lines.append(
            f"| {it.run.name} | {it.run.group} | {p.get('started_utc', '?')} | "
            f"{p.get('wall_s') or '?'} | "
            f"{p.get('returncode', '?')} | {str(p.get('source_commit', '?'))[:10]} | `{cmd}` |"
        )
    return "\n".join(lines)


def build_page(runs, out: Path, page: Path, invocation: str) -> None:
    """Write the results page and its plots from whatever runs of the plan have finished."""
    from study import COMMON, MAIN, ONES_CHECK, PROBE, machine, utc_now  # noqa: PLC0415

    loaded = load(runs, out)
    missing = [r.name for r in runs if r.name not in loaded]
    page.parent.mkdir(parents=True, exist_ok=True)
    figs = page.parent / "evidence"
    figs.mkdir(exist_ok=True)
    main = by_method(loaded, "main")
    probe = by_method(loaded, "probe")
    ablation = by_method(loaded, "ablation")
    abl_seeds = sorted({it.run.seed for items in ablation.values() for it in items})
    matched = {
        m: [it for it in items if it.run.seed in abl_seeds]
        for m, items in main.items()
        if m in ("grpo", "cagrpo")
    }
    abl_groups = {**matched, **ablation}

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
        plot_curves(
            probe,
            "entropy/mean",
            "Probe: policy entropy",
            "nats per token",
            figs / "probe_entropy.png",
        )
    if ablation:
        plot_curves(
            abl_groups,
            "entropy/mean",
            "Ablations (seed-matched): policy entropy",
            "nats per token",
            figs / "ablation_entropy.png",
        )
    kernel_runs = [
        it
        for it in loaded.values()
        if it.run.method.startswith("cagrpo")
        and it.run.group in ("main", "ablation")
        and it.run.method != "cagrpo_ones"
    ]
    if kernel_runs:
        plot_kernel(kernel_runs, figs / "kernel_weights.png")

    checks = "\n\n".join(
        f"**{title}**: {verdict}.\n\n{table}" for title, verdict, table in identity_checks(loaded)
    )
    m = machine()
    any_eval = next(
        (it.summary.get("eval_before") for it in loaded.values() if "eval_before" in it.summary), {}
    )
    p0 = any_eval.get("pass@1", 0.3)
    se = eval_se(p0, any_eval.get("num_prompts", 200), any_eval.get("samples", 4))
    commit = (
        (out / "SOURCE_COMMIT").read_text().strip() if (out / "SOURCE_COMMIT").exists() else "?"
    )
    discussion = (
        DISCUSSION.read_text() if DISCUSSION.exists() else "_(no discussion written yet)_\n"
    )
    rel = "evidence"
    times = sorted(
        t
        for it in loaded.values()
        for t in (
            (it.provenance or {}).get("started_utc"),
            (it.provenance or {}).get("finished_utc"),
        )
        if t
    )
    span = f"{times[0]} and {times[-1]} (UTC)" if times else "?"

    machine_text = (
        f"`nproc` = {m['nproc']}, CPU: {m['cpu']}, RAM {m['ram_gib']} GiB, {m['os']}, "
        f"Python {m['python']}"
    )
    main_seeds = sorted({it.run.seed for items in main.values() for it in items}) or "(none)"
    missing_text = (
        "* **Planned but not run** (the compute budget ran out; the study command runs them): "
        + ", ".join(missing)
        + ". Tables show n per cell."
        if missing
        else "* Every planned run finished."
    )

    def opts(d: dict) -> str:
        return " ".join(f"`{k}={v}`" for k, v in d.items())

    text = f"""# Evidence: CA-GRPO vs GRPO, Clip-Cov and KL-Cov at CPU scale

This page tests the claims of "Taming Extreme Tokens" (arXiv 2605.11538) — that CA-GRPO beats
GRPO and Clip-Cov on reasoning accuracy and keeps policy entropy stable where GRPO's collapses
or rebounds — with the built-in `chain_sum` policy (~1.8M parameters) on CPU. It is generated
by `experiments/study.py`; every table below is computed from the runs listed at the end.

{discussion}
## Setup

* Rebuild everything: `.venv/bin/python experiments/study.py --out runs/study`; rebuild this page
  from finished runs: `.venv/bin/python experiments/study.py --out runs/study --aggregate-only`.
  This page was produced by: `{invocation}` on {utc_now()}.
* Source: every run started by the study script executes from a snapshot (`git archive`) of
  commit `{commit}` of this repository (the probe: see "Every run"), base config
  `configs/cpu-tiny.yaml`, with `{", ".join(f"{k}={v}" for k, v in COMMON.items())}`.
* Machine: {machine_text}.
  Runs were serialized with `flock` on a machine shared with other work, so wall times vary.
  Runs made between {span}.
* Policy and task: the `chain_sum` preset writes `<think>partial sums</think><answer>N</answer>`
  (~17-27 tokens); reward = correctness + 0.1 × format. Per step: 16 prompts × 8 samples
  (group size 8), one optimizer step (AdamW), max 64 new tokens, temperature 1.
* Probe: {opts(PROBE)}, seed 0, GRPO and CA-GRPO.
* Main grid: {opts(MAIN)}; methods grpo, clip_cov, kl_cov, cagrpo × seeds
  {main_seeds}. `run.seed` fixes data order,
  sampling and learner RNG, so runs of one seed see the same first batch and are compared paired.
* Held-out eval: 200 prompts × 4 samples at temperature 1 (fixed sampling seed), at step 0,
  every `run.eval_every` steps, and after the last step. A single pass@1 estimate near {p0:.2f}
  has a binomial standard error of at least {se:.3f} (more, since samples of one prompt correlate).
* Ablations (seeds {abl_seeds or "(none finished)"}, same budget as the main grid):
  `algorithm.cov_scope=batch`;
  `algorithm.cagrpo_kernel=unnormalized`. Identity check: {opts(ONES_CHECK)}, seed 0, GRPO vs
  `algorithm.policy_loss=cagrpo algorithm.cagrpo_kernel=ones`.
{missing_text}

## Regime facts

{regime_facts(loaded)}

## Held-out accuracy (main grid, mean ± std over seeds)

pass@1:

{heldout_table(main, "pass@1")}

pass@4:

{heldout_table(main, "pass@4")}

Paired difference to GRPO of the same seed, pass@1:

{paired_delta_table(main, "pass@1")}

Paired difference to GRPO of the same seed, pass@4:

{paired_delta_table(main, "pass@4")}

![held-out accuracy]({rel}/heldout.png)

## Entropy

Entropy of the policy's next-token distribution at the response positions of each training
batch (`entropy/mean`, nats per token, token mean).
Thin lines: single seeds; thick: mean over seeds.

![entropy]({rel}/entropy.png)

{trajectory_table(main, ENTROPY_KEYS + [("response/length_mean", "length")])}

Gradient norm before clipping (`learner/grad_norm`) and the share of groups whose rewards are
all equal (no gradient), same windows:

{trajectory_table(main, [GRAD_KEY, ("reward/equal_reward_groups", "equal-reward groups")])}

Per run (early = first {EARLY} steps, late = last {EARLY}):

{entropy_shape_table(main)}

![training accuracy]({rel}/train_accuracy.png)
![response length]({rel}/response_length.png)

## Covariance of log-prob and advantage (the paper's table)

Thresholds of the top and bottom 0.01%, 1%, 20% and 40% of token covariances
c = (log π − mean log π)(A − mean A), over each prompt group's tokens, averaged over the first
{EARLY} ("early") or last {EARLY} ("late") steps and over seeds. A batch holds ~2,400 tokens, so
the 0.01% threshold is essentially the extreme token; each of the two learner ranks computes the
quantiles of its half of the batch and the logged value is their token-weighted mean.

{covariance_table(main)}

![covariance quantiles]({rel}/covariance.png)

## CA-GRPO kernel weights during training

`weight_*`: statistics of the normalized weights w~ (mean 1 per group by construction) over the
batch's tokens; `frac_below_0.5`: share of tokens whose advantage is more than halved;
`sigma_mean`: token-weighted mean of the scope's covariance spread σ; `degenerate_frac`: share
of tokens in scopes with σ < 1e-8 (all weights 1: groups whose rewards are all equal, which
have zero advantage and no gradient anyway). Early = first {EARLY} steps, late = last {EARLY}.

{kernel_table(kernel_runs)}

![kernel weights]({rel}/kernel_weights.png)

## Ablations (compared with the main-grid GRPO and CA-GRPO runs of the same seeds)

pass@1:

{heldout_table(abl_groups, "pass@1")}

{trajectory_table(abl_groups, ENTROPY_KEYS + [GRAD_KEY])}

![ablation entropy]({rel}/ablation_entropy.png)

### Runs that must train identically

Per-step metrics compared exactly (timing metrics and CA-GRPO's own `cagrpo/*` diagnostics
excluded); when nothing differs, a few metrics are listed to show the comparison was made.

{checks or "(not run)"}

## Inside one batch: what the kernel removes

`experiments/kernel_anatomy.py` samples one on-policy batch from the untrained policy, computes
GRPO's and CA-GRPO's token-mean policy-gradient surrogates (ratio 1, as in every run here),
their gradients, and the gradient of the tokens CA-GRPO down-weights below 0.5 alone; then it
applies one AdamW first step (θ − lr·sign(g), lr = the first warm-up step's) along each and
measures, on the same batch, the policy's mean entropy and the mean log-likelihood of the
correct and the incorrect responses.

{anatomy_section(out)}

## Probe (chose the regime)

One probe, run before the grid: GRPO improved steadily and its entropy drifted down without the
policy breaking, so its settings became the main grid's unchanged. It was the only probe.

pass@1:

{heldout_table(probe, "pass@1")}

{trajectory_table(probe, ENTROPY_KEYS + [GRAD_KEY])}

![probe entropy]({rel}/probe_entropy.png)

## Every run

Each run's folder holds `metrics.jsonl` (per step), `summary.json`, `config.json` and
`provenance.json` (command, overrides, commit, machine, start and end time). "wall s" includes
the time a run waited for the CPU lock while other work held it. Runs started by
`experiments/study.py` ran in the snapshot `<out>/src-<commit>` (`git archive <commit> cagrpo_ray
configs`) as working directory, with `RAY_AUTH_MODE=disabled PYTHONPATH=<the snapshot>`. The two
probe runs were started by hand, with the same overrides, before the study script existed, from
the repository's working tree: probe-grpo-s0 at commit 0b1ba16, probe-cagrpo-s0 at 5810d2e with
`cagrpo_ray/` and `configs/` unmodified; 5810d2e differs from 0b1ba16 only in the async trainer
and the Prometheus exporter, which these sync runs with `metrics.enabled=false` do not use.

{provenance_rows(loaded)}
"""
    page.write_text(text)
    print(f"[study] wrote {page} ({len(loaded)} runs, {len(missing)} missing)")
