"""How much of a core a background process takes from a run in a session of its own.

    .venv/bin/python benchmarks/bench_priority.py [--seconds 4]

`make test` runs the unit tests and the `beside` integration tests in the background, meant to
take only the CPU that the integration tier leaves idle. The runs the integration tests start
lead sessions of their own (`python -m cagrpo_ray.run` runs its driver in a new session), and
with Linux's autogroup scheduling the CPU is shared between sessions first: a process's nice
value ranks it only inside its own session. Each variant pins a busy loop standing for the run
(nice 0, a new session) and one standing for the background process to the same core for
`--seconds`, and prints the share of the core each got.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOWEST = HERE.parent / "tests" / "lowest_priority.py"
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {0})
start, end = time.process_time(), time.time() + float(sys.argv[1])
while time.time() < end:
    pass
print(f"{(time.process_time() - start) / float(sys.argv[1]):.2f}")
"""

VARIANTS = {  # the background process's command prefix, and whether it leads a new session
    "nice 19, the test session": (["nice", "-n", "19"], False),
    "lowest_priority.py (nice 19, its own autogroup at 19)": ([sys.executable, str(LOWEST)], True),
    "nice 0, the test session (no priority at all)": ([], False),
}


def shares(prefix: list[str], new_session: bool, seconds: float) -> tuple[float, float]:
    """(the run's share of the core, the background process's share)."""
    spin = [sys.executable, "-c", SPIN, str(seconds)]
    run = subprocess.Popen(spin, stdout=subprocess.PIPE, text=True, start_new_session=True)
    background = subprocess.Popen(
        prefix + spin, stdout=subprocess.PIPE, text=True, start_new_session=new_session
    )
    return float(run.communicate()[0]), float(background.communicate()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    enabled = autogroup.read_text().strip() if autogroup.exists() else "absent"
    print(f"kernel.sched_autogroup_enabled: {enabled}; one core shared for {args.seconds:g} s")
    print(f"| {'background process':<54} | run's share | background's share |")
    print(f"|{'-' * 56}|-------------|--------------------|")
    for name, (prefix, new_session) in VARIANTS.items():
        run, background = shares(prefix, new_session, args.seconds)
        print(f"| {name:<54} | {run:>11.2f} | {background:>18.2f} |")


if __name__ == "__main__":
    main()
