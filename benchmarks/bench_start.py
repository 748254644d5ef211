"""Where a run's first minute goes: `python -m cagrpo_ray.run` from the command to its first
training step, phase by phase: compiled engines (the default), compiled engines with vLLM's
engine-core process spawned as vLLM does (as before `ForkedEngineCore`, which forks it from the
replica's actor), and eager engines, side by side.

    flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_start.py [--repeats 2]
        [--config configs/cpu-tiny.yaml] [--out benchmarks/results/bench_start.md]

Every user pays a run's start, and the integration tests pay it about thirty times. Each start
here is the command as a user types it (its own local Ray cluster, `run.steps=1`), the variants
alternating, after one untimed start of each (which fills the caches a machine keeps between
runs: vLLM's compiled kernels, DeepSpeed's extension). The phases are read from the times the
console's lines arrive (to a tenth of a second) and from the actors' own log files (to the
second), each measured from the command's start:

- **Ray cluster**: the local cluster started (the driver's "Started a local Ray instance");
- **policy and data**: the policy resolved, the prompts drawn (the console's "policy" line);
- **plan**: the memory planner's check (its "plan:" line);
- **generators import vLLM**: the last replica's actor has vLLM imported (its first vLLM line);
- **engine core**: the last replica's engine-core process is up (its first line);
- **worker and model**: the last replica's worker (in its engine core, or a process of its own
  with `VLLM_ENABLE_V1_MULTIPROCESSING=1`) has loaded the model and starts warming up;
- **warm-up**: the last replica's engine is ready ("init engine ... took");
- **roles ready**: learners, the weight-sync group and the exporter are up (the "metrics for
  Prometheus" line);
- **evaluation before**: the step-0 held-out evaluation logged;
- **first step**: the first training step logged.

Each row is a phase's end (median over the repeats) and what it added to the one before.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from cagrpo_ray.metrics.provenance import report

REPO = Path(__file__).resolve().parent.parent
# label: (--set overrides, environment)
VARIANTS = {
    "compiled engines (the default)": ([], {}),
    "compiled, spawned engine core": ([], {"CAGRPO_FORK_ENGINE_CORE": "0"}),
    "eager engines": (["rollout.enforce_eager=true"], {}),
}
CLOCK = re.compile(r"\b(\d\d):(\d\d):(\d\d)\b")
# (phase, where it is read, the pattern whose first match ends it)
CONSOLE_PHASES = [
    ("policy and data", re.compile(r"INFO cagrpo_ray: policy ")),
    ("plan", re.compile(r"INFO cagrpo_ray: plan:")),
    ("roles ready", re.compile(r"metrics for Prometheus at")),
    ("evaluation before", re.compile(r"eval \(before, step 0\)")),
    ("first step", re.compile(r"INFO cagrpo_ray: step 1/")),
]
LOG_PHASES = [  # in logs/generator-<replica>.log: the last replica's time counts
    ("generators import vLLM", re.compile(r"\(MainProcess pid=\d+\)")),
    ("engine core", re.compile(r"\(EngineCore pid=\d+\)")),
    ("worker and model", re.compile(r"Warming up model|init engine")),
    ("warm-up", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
]
ORDER = [
    "Ray cluster", "policy and data", "plan", "generators import vLLM", "engine core",
    "worker and model", "warm-up", "roles ready", "evaluation before", "first step",
]  # fmt: skip


def clock_seconds(line: str, started: datetime) -> float | None:
    """Seconds from `started` to the HH:MM:SS in `line` (same day), or None."""
    found = CLOCK.search(line)
    if not found:
        return None
    h, m, s = map(int, found.groups())
    at = started.replace(hour=h, minute=m, second=s, microsecond=0)
    return (at - started).total_seconds()


def first_match(lines, pattern, started: datetime) -> float | None:
    for line in lines:
        if pattern.search(line):
            return clock_seconds(line, started)
    return None


def one_start(config: str, sets: list[str], extra_env: dict, out: Path) -> dict[str, float]:
    """One run of the command to its first step; the phases' ends in seconds."""
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", config]
    for item in [f"run.output_dir={out}", "run.name=start", "run.steps=1", "metrics.port=0",
                 "metrics.inspect_port=null", *sets]:  # fmt: skip
        command += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", **extra_env)
    started, t0 = datetime.now(), time.monotonic()
    ends: dict[str, float] = {}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    timer = threading.Timer(900, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            for phase, pattern in CONSOLE_PHASES:
                if phase not in ends and pattern.search(line):
                    ends[phase] = time.monotonic() - t0
    finally:
        timer.cancel()
        status = process.wait()
    if status != 0 or "first step" not in ends:
        raise RuntimeError(f"the run failed (exit {status}); see {out}/start/logs")
    logs = out / "start" / "logs"
    driver = (logs / "driver.log").read_text().splitlines()
    ray_up = first_match(driver, re.compile(r"Started a local Ray instance"), started)
    if ray_up is not None:
        ends["Ray cluster"] = ray_up
    for phase, pattern in LOG_PHASES:
        times = [first_match(path.read_text().splitlines(), pattern, started)
                 for path in sorted(logs.glob("generator-*.log"))]  # fmt: skip
        if times and None not in times:
            ends[phase] = max(times)
    return ends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append the result to this file")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        for repeat in range(args.repeats + 1):
            for number, (label, (sets, extra_env)) in enumerate(VARIANTS.items()):
                out = Path(tmp) / f"{repeat}-{number}"
                ends = one_start(args.config, sets, extra_env, out)
                print(
                    f"{label}, start {repeat}: "
                    + ", ".join(f"{p} {ends[p]:.1f}" for p in ORDER if p in ends),
                    flush=True,
                )
                if repeat:  # the first start of each fills the caches
                    runs[label].append(ends)
    rows = []
    medians = {label: {p: statistics.median(r[p] for r in results)
                       for p in ORDER if all(p in r for r in results)}
               for label, results in runs.items()}  # fmt: skip
    for phase in ORDER:
        row = [phase]
        for label in VARIANTS:
            m = medians[label]
            if phase not in m:
                row.append("-")
                continue
            before = [m[p] for p in ORDER[: ORDER.index(phase)] if p in m]
            added = m[phase] - (before[-1] if before else 0.0)
            row.append(f"{m[phase]:.1f} (+{added:.1f})")
        rows.append(row)
    report(
        f"A run's start, phase by phase ({args.config}, the command to its first step)",
        ["phase ends at s (+ s it added)", *VARIANTS],
        rows,
        out=args.out,
        notes=[f"Median of {args.repeats} starts of each variant after one untimed start of "
               "each; the generator phases are the last replica's, read to the second from its "
               "log, the others from the console to a tenth of a second."],
        command="flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_start.py "
        f"--repeats {args.repeats} --config {args.config}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
