"""The evidence study's results page: `study_page.md` filled with the tables and figures.

The page's prose lives in the template `study_page.md` (placeholders such as `{heldout_pass1}`),
the interpretation in `evidence_discussion.md`; every number, and every commit the page names,
comes from the runs on disk and the provenance the runner recorded with them. Nothing here
trains; `study.py --aggregate-only` calls only `write_page`.
"""

from __future__ import annotations

from pathlib import Path

from study_plan import COMMON, CONFIG, MAIN, METHODS, ONES_CHECK, PROBE, Run
from study_plots import draw_figures
from study_results import EARLY, Loaded, by_method, eval_se, load
from study_tables import (
    COV_KEYS,
    COV_NAMES,
    WEIGHT_KEYS,
    anatomy_section,
    entropy_shape_table,
    heldout_table,
    identity_checks,
    paired_delta_table,
    provenance_table,
    regime_facts,
    trajectory_table,
    window_table,
)

from cagrpo_ray.metrics.provenance import describe_machine, machine, utc_now

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "study_page.md"
DISCUSSION = HERE / "evidence_discussion.md"
FIGURES = "evidence"  # folder of the PNGs, next to the page
ENTROPY_KEYS = [("entropy/mean", "entropy"), ("accuracy/train", "train acc")]
GRAD_KEY = ("learner/grad_norm", "grad norm")


def source_commit(out: Path, loaded: dict[str, Loaded]) -> str:
    """The commit the study's runs executed: the pin in `<out>/SOURCE_COMMIT`, or else the
    commits the runs' provenance records (the hand-started probe aside)."""
    pin = out / "SOURCE_COMMIT"
    if pin.exists():
        return pin.read_text().strip()
    recorded = {
        it.provenance.get("source_commit") for it in loaded.values() if it.run.group != "probe"
    }
    return ", ".join(sorted(c for c in recorded if c)) or "?"


def probe_commits(loaded: dict[str, Loaded]) -> str:
    """Which commit each probe run recorded, as "<run> at commit <short hash>, ..."."""
    shown = [
        f"{it.run.name} at commit {str(it.provenance.get('source_commit', '?'))[:7]}"
        for it in loaded.values()
        if it.run.group == "probe"
    ]
    return ", ".join(shown) or "no probe run recorded"


def run_machine(loaded: dict[str, Loaded]) -> str:
    """The machine the runs recorded (the first that did), else the one rendering the page."""
    recorded = [it.provenance["machine"] for it in loaded.values() if "machine" in it.provenance]
    m = recorded[0] if recorded else machine()
    return f"{describe_machine(m)}, {m.get('os', 'OS unknown')}"


def run_span(loaded: dict[str, Loaded]) -> str:
    """First start to last finish over the runs' recorded provenance."""
    times = sorted(
        t
        for it in loaded.values()
        for key in ("started_utc", "finished_utc")
        if (t := it.provenance.get(key))
    )
    return f"{times[0]} and {times[-1]} (UTC)" if times else "?"


def options(settings: dict[str, str]) -> str:
    """Overrides as inline code, `key=value` each."""
    return " ".join(f"`{k}={v}`" for k, v in settings.items())


def render_page(runs: list[Run], out: Path, page: Path, invocation: str) -> tuple[str, list[str]]:
    """The page's markdown from whatever runs of the plan have finished under `out`, drawing
    its figures into `<page folder>/evidence/` on the way; also the names of the missing runs."""
    loaded = load(runs, out)
    missing = [r.name for r in runs if r.name not in loaded]
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
    kernel_runs = [
        it
        for it in loaded.values()
        if it.run.method.startswith("cagrpo")
        and it.run.group in ("main", "ablation")
        and it.run.method != "cagrpo_ones"
    ]
    draw_figures(main, probe, abl_groups, kernel_runs, page.parent / FIGURES)

    any_eval = next(
        (it.summary.get("eval_before") for it in loaded.values() if "eval_before" in it.summary), {}
    )
    p0 = any_eval.get("pass@1", 0.3)
    checks = "\n\n".join(
        f"**{title}**: {verdict}.\n\n{table}" for title, verdict, table in identity_checks(loaded)
    )
    main_seeds = sorted({it.run.seed for items in main.values() for it in items})
    fields = {
        "discussion": (
            DISCUSSION.read_text() if DISCUSSION.exists() else "_(no discussion written yet)_\n"
        ),
        "invocation": invocation,
        "rendered_utc": utc_now(),
        "commit": source_commit(out, loaded),
        "config": CONFIG,
        "common": ", ".join(f"{k}={v}" for k, v in COMMON.items()),
        "machine": run_machine(loaded),
        "span": run_span(loaded),
        "probe_options": options(PROBE),
        "main_options": options(MAIN),
        "ones_check_options": options(ONES_CHECK),
        "methods": ", ".join(METHODS),
        "main_seeds": main_seeds or "(none)",
        "p0": p0,
        "se": eval_se(p0, any_eval.get("num_prompts", 200), any_eval.get("samples", 4)),
        "ablation_seeds": abl_seeds or "(none finished)",
        "missing": (
            "* **Planned but not run** (the compute budget ran out; the study command runs them): "
            + ", ".join(missing)
            + ". Tables show n per cell."
            if missing
            else "* Every planned run finished."
        ),
        "regime_facts": regime_facts(loaded),
        "heldout_pass1": heldout_table(main, "pass@1"),
        "heldout_pass4": heldout_table(main, "pass@4"),
        "paired_pass1": paired_delta_table(main, "pass@1"),
        "paired_pass4": paired_delta_table(main, "pass@4"),
        "figures": FIGURES,
        "early": EARLY,
        "entropy_trajectory": trajectory_table(
            main, ENTROPY_KEYS + [("response/length_mean", "length")]
        ),
        "gradient_trajectory": trajectory_table(
            main, [GRAD_KEY, ("reward/equal_reward_groups", "equal-reward groups")]
        ),
        "entropy_shape": entropy_shape_table(main),
        "covariance_table": window_table(main, COV_KEYS, COV_NAMES, "+.3g"),
        "kernel_table": window_table(
            {it.run.name: [it] for it in kernel_runs},
            WEIGHT_KEYS,
            [k.split("/")[1] for k in WEIGHT_KEYS],
            ".4g",
            label="run",
        ),
        "ablation_heldout": heldout_table(abl_groups, "pass@1"),
        "ablation_trajectory": trajectory_table(abl_groups, ENTROPY_KEYS + [GRAD_KEY]),
        "identity_checks": checks or "(not run)",
        "anatomy": anatomy_section(out),
        "probe_heldout": heldout_table(probe, "pass@1"),
        "probe_trajectory": trajectory_table(probe, ENTROPY_KEYS + [GRAD_KEY]),
        "probe_commits": probe_commits(loaded),
        "provenance_table": provenance_table(loaded),
    }
    return TEMPLATE.read_text().format(**fields), missing


def write_page(runs: list[Run], out: Path, page: Path, invocation: str) -> None:
    """Write the results page and its figures from whatever runs of the plan have finished."""
    page.parent.mkdir(parents=True, exist_ok=True)
    text, missing = render_page(runs, out, page, invocation)
    page.write_text(text)
    print(f"[study] wrote {page} ({len(runs) - len(missing)} runs, {len(missing)} missing)")
