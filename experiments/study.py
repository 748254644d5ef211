"""The evidence study: does CA-GRPO beat GRPO, Clip-Cov and KL-Cov at CPU scale?

One command reruns everything and rebuilds the results page:

    .venv/bin/python experiments/study.py --out runs/study

Every run is a subprocess `python -m cagrpo_ray.run` under `flock /tmp/cagrpo-cpu.lock`, so that
on a shared machine no two trainings compete for the CPUs. A run whose `summary.json` exists is
skipped, which makes the study resumable after an interruption. Runs execute from a pinned
snapshot of the package (`git archive` of one commit, recorded in `<out>/SOURCE_COMMIT`), so that
edits to the working tree during a long study cannot make its runs incomparable.

`--aggregate-only` rebuilds `docs/results/evidence-round1.md` (round 1; round 2 is
`study2.py`) and its plots from the runs on disk.
What runs is `study_plan.py`; the page is the template `study_page.md`, filled by
`study_page.py` with the tables (`study_tables.py`) and figures (`study_plots.py`) computed
from the runs. The interpretation (what the numbers mean) lives in
`experiments/evidence_discussion.md` and is included in the page verbatim.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from study_page import write_page
from study_plan import CONFIG, Run, plan

from cagrpo_ray.metrics.provenance import git_commit, machine, utc_now

REPO = Path(__file__).resolve().parents[1]
LOCK = "/tmp/cagrpo-cpu.lock"


def pinned_source(out: Path) -> tuple[str, Path]:
    """The commit the study runs (fixed at its first run) and a snapshot of its package."""
    pin = out / "SOURCE_COMMIT"
    commit = pin.read_text().strip() if pin.exists() else git_commit(REPO, (), short=False)
    if commit == "unknown":
        raise SystemExit(f"{REPO} is not a git checkout: the study runs a pinned commit of it")
    pin.write_text(commit + "\n")
    src = out / f"src-{commit[:12]}"
    if not src.exists():
        tmp = out / f".src-{commit[:12]}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", commit, "cagrpo_ray", "configs"],
            cwd=REPO,
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        tmp.rename(src)
    return commit, src


def command(run: Run, out: Path) -> list[str]:
    """The exact argv of one run (relative to the source snapshot it runs in)."""
    argv = [
        "flock",
        LOCK,
        str(REPO / ".venv/bin/python"),
        "-m",
        "cagrpo_ray.run",
        "--config",
        CONFIG,
    ]
    for key, value in {**run.settings(), "run.output_dir": str(out.resolve())}.items():
        argv += ["--set", f"{key}={value}"]
    return argv


def ended_summary(run_dir: Path) -> dict | None:
    """The summary of a run that ended on its own, else None: a run a signal stopped writes a
    summary too (with `stopped_at`), and resumes from its checkpoint rather than being skipped."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return None
    loaded = json.loads(summary.read_text())
    return None if "stopped_at" in loaded else loaded


def execute(run: Run, out: Path, commit: str, src: Path, argv: list[str] | None = None) -> None:
    """Run one training (skipped when it ended on its own: `ended_summary`) and record its
    provenance; `argv` replaces round 1's command (`command`) for the later rounds' configs."""
    run_dir = out / run.name
    if ended_summary(run_dir) is not None:
        print(f"[study] {run.name}: done already, skipped", flush=True)
        return
    argv = argv or command(run, out)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(src.resolve())}
    print(f"[study] {run.name}: {shlex.join(argv)}", flush=True)
    started, t0 = utc_now(), time.monotonic()
    with (out / f"{run.name}.log").open("a" if "--resume" in argv else "w") as log:
        rc = subprocess.run(argv, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    provenance = {
        "command": shlex.join(argv),
        "cwd": f"snapshot of {commit} (git archive {commit} cagrpo_ray configs)",
        "env": {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": "<the snapshot>"},
        "overrides": run.settings(),
        "source_commit": commit,
        "started_utc": started,
        "finished_utc": utc_now(),
        "wall_s": round(time.monotonic() - t0, 1),
        "returncode": rc,
        "machine": machine(),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=2))
    if rc != 0:
        print(f"[study] {run.name}: FAILED (rc {rc}); see {out / run.name}.log", flush=True)


def anatomy_command(out: Path) -> list[str]:
    return [
        "flock",
        LOCK,
        str(REPO / ".venv/bin/python"),
        str(REPO / "experiments/kernel_anatomy.py"),
        "--out",
        str((out / "anatomy.json").resolve()),
    ]


def run_anatomy(out: Path, src: Path) -> None:
    """The one-batch look inside the kernel (experiments/kernel_anatomy.py) on the pinned
    package, unless done."""
    if (out / "anatomy.json").exists():
        return
    argv = anatomy_command(out)
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    print(f"[study] anatomy: {shlex.join(argv)}", flush=True)
    with (out / "anatomy.log").open("w") as log:
        subprocess.run(argv, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs/study", help="Run folder.")
    parser.add_argument("--page", type=Path, default=REPO / "docs/results/evidence-round1.md")
    parser.add_argument("--aggregate-only", action="store_true", help="Only rebuild the page.")
    parser.add_argument("--only", nargs="*", help="Run only these groups (probe, main, ...).")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands, run nothing.")
    args = parser.parse_args(argv)
    runs = plan()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.aggregate_only:
        commit, src = pinned_source(args.out)
        for run in runs:
            if args.only and run.group not in args.only:
                continue
            if (args.out / "STOP").exists():  # ends a long study cleanly between two runs
                print(f"[study] {args.out / 'STOP'} exists: no more runs started", flush=True)
                break
            if args.dry_run:
                print(shlex.join(command(run, args.out)))
            else:
                execute(run, args.out, commit, src)
        if not args.dry_run and not (args.out / "STOP").exists():
            run_anatomy(args.out, src)
    if not args.dry_run:
        invocation = shlex.join([".venv/bin/python", *sys.argv])
        write_page(runs, args.out, args.page, invocation=invocation)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
