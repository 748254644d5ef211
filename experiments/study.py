"""The evidence study: does CA-GRPO beat GRPO, Clip-Cov and KL-Cov at CPU scale?

One command reruns everything and rebuilds the results page:

    .venv/bin/python experiments/study.py --out runs/study

Every run is a subprocess `python -m cagrpo_ray.run` under `flock /tmp/cagrpo-cpu.lock`, so that
on a shared machine no two trainings compete for the CPUs. A run whose `summary.json` exists is
skipped, which makes the study resumable after an interruption. Runs execute from a pinned
snapshot of the package (`git archive` of one commit, recorded in `<out>/SOURCE_COMMIT`), so that
edits to the working tree during a long study cannot make its runs incomparable.

`--aggregate-only` rebuilds `docs/results/evidence.md` and its plots from the runs on disk.
The interpretation (what the numbers mean) lives in `experiments/evidence_discussion.md` and is
included in the page verbatim; every number on the page is computed here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import study_report  # noqa: E402  (the aggregation half, kept apart so each file stays small)

LOCK = "/tmp/cagrpo-cpu.lock"
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


# ----------------------------------------------------------------------------- provenance


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def machine() -> dict[str, str]:
    """What the numbers were measured on: core count, CPU model, RAM, OS."""
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return {
        "nproc": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
        "cpu": cpu,
        "ram_gib": f"{mem_kib / 2**20:.1f}",
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pinned_source(out: Path) -> tuple[str, Path]:
    """The commit the study runs (fixed at its first run) and a snapshot of its package."""
    pin = out / "SOURCE_COMMIT"
    commit = pin.read_text().strip() if pin.exists() else git("rev-parse", "HEAD")
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


def execute(run: Run, out: Path, commit: str, src: Path) -> None:
    """Run one training (skipped when its summary exists) and record its provenance."""
    run_dir = out / run.name
    if (run_dir / "summary.json").exists():
        print(f"[study] {run.name}: done already, skipped", flush=True)
        return
    argv = command(run, out)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(src.resolve())}
    print(f"[study] {run.name}: {shlex.join(argv)}", flush=True)
    started, t0 = utc_now(), time.monotonic()
    with (out / f"{run.name}.log").open("w") as log:
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
    parser.add_argument("--page", type=Path, default=REPO / "docs/results/evidence.md")
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
        study_report.build_page(runs, args.out, args.page, invocation=invocation)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
