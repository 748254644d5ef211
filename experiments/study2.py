"""The second evidence round: fair learning rates, several temperatures, the late phase, the
Cov baselines where they act, the kernel's mechanism, and a kappa-controlled CA-GRPO.

One command runs it (resumable: a run whose summary exists is skipped) and rebuilds the page:

    .venv/bin/python experiments/study2.py --out runs/study2

What runs and the rules that choose settings from runs are in `study2_plan.py`; runs execute
as in round 1 (`study.py`): a subprocess `python -m cagrpo_ray.run` on a pinned snapshot of the
package, serialized by `flock`, each with its provenance. The choices the rules made (each
method's best lr, the late-phase regime, and why) are written to `<out>/choices.json` as soon
as the runs they depend on have finished. `touch <out>/STOP` ends the study between two runs;
`--aggregate-only` only rebuilds `docs/results/evidence.md` from the runs on disk.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from study import command, execute, pinned_source
from study2_plan import best_lr, collapse_verdict, late_regime, search_runs, stages, sweep_runs
from study_results import load

REPO = Path(__file__).resolve().parents[1]


def choices(out: Path) -> dict:
    """The rules' choices from the finished runs (each only once its runs have all finished)."""
    made: dict = {}
    sweep = load(sweep_runs(), out)
    if len(sweep) == len(sweep_runs()):
        made["best_lr"] = best_lr({name: run.records for name, run in sweep.items()})
    search = load(search_runs(), out)
    if len(search) == len(search_runs()):
        verdicts = {
            run.run.name.split("-")[2]: collapse_verdict(run.records, run.heldout())
            for run in search.values()
        }
        key, why = late_regime(verdicts)
        made.update(late=key, late_why=why, verdicts=verdicts)
    return made


def planned(out: Path, group: str | None = None) -> list:
    """The runs the rules plan so far, in order; with `group`, only that group's."""
    made = choices(out)
    runs = [run for stage in stages(made.get("best_lr"), made.get("late")) for run in stage]
    return [run for run in runs if group in (None, run.group)]


def selected(args) -> list:
    """The planned runs `--only` and `--run` select, in plan order or in `--run`'s order."""
    runs = planned(args.out, args.only)
    if not args.run:
        return runs
    return sorted((r for r in runs if r.name in args.run), key=lambda r: args.run.index(r.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs/study2", help="Run folder.")
    parser.add_argument("--page", type=Path, default=REPO / "docs/results/evidence.md")
    parser.add_argument("--aggregate-only", action="store_true", help="Only rebuild the page.")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands, run nothing.")
    parser.add_argument(
        "--only",
        metavar="GROUP",
        help="Run only the planned runs of this group (sweep, search, late, mechanism, kappa, "
        "best), e.g. the seed replicates at the best lrs before the long search runs.",
    )
    parser.add_argument(
        "--run",
        action="append",
        metavar="NAME",
        help="Run only these planned runs, in the order given (repeatable); a name the plan "
        "does not hold is an error. For running part of a stage first when time is short.",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        unknown = sorted(set(args.run) - {r.name for r in planned(args.out, args.only)})
        if unknown:
            parser.error(f"--run: not in the plan (so far): {', '.join(unknown)}")
    if args.dry_run:
        for run in selected(args):
            print(shlex.join(command(run, args.out)))
        return 0
    if not args.aggregate_only:
        commit, src = pinned_source(args.out)
        attempted: set[str] = set()
        while not (args.out / "STOP").exists():
            (args.out / "choices.json").write_text(json.dumps(choices(args.out), indent=2))
            pending = [r for r in selected(args) if r.name not in attempted]
            if not pending:
                break
            attempted.add(pending[0].name)
            execute(pending[0], args.out, commit, src)
        if (args.out / "STOP").exists():
            print(f"[study2] {args.out / 'STOP'} exists: no more runs started", flush=True)
        (args.out / "choices.json").write_text(json.dumps(choices(args.out), indent=2))
    from study2_page import write_page

    # The command that reruns the whole plan, whichever part of it this call ran.
    out = args.out.resolve()
    out = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    invocation = shlex.join([".venv/bin/python", "experiments/study2.py", "--out", str(out)])
    write_page(planned(args.out), args.out, args.page, invocation=invocation)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
