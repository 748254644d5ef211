"""Where a test run's time went: each tier's wall time and the slowest tests of all tiers.

    python tests/times_report.py runs/test-times

reads the `--times-file` files that `make test` has each pytest session write there
(`unit.tsv`, `integration.tsv`, `integration.beside.tsv`: one line per test phase, then the
session's wall time) and prints, for each, its wall time and test count, then the N slowest
tests (setup, call and teardown together: a module's shared set-up counts in its first test).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read_times(path: Path) -> tuple[float | None, dict[str, float], dict[str, str]]:
    """(the session's wall seconds or None if it did not finish, seconds per test, outcome
    of each test's call phase, or of the phase that failed)."""
    wall, seconds, outcome = None, defaultdict(float), {}
    for line in path.read_text().splitlines():
        when, duration, result, nodeid = (line.split("\t") + [""] * 4)[:4]
        if when == "session":
            wall = float(duration)
            continue
        seconds[nodeid] += float(duration)
        if result != "passed":  # a failed or skipped phase names the test's outcome
            outcome[nodeid] = result
        elif when == "call":
            outcome.setdefault(nodeid, result)
    return wall, dict(seconds), outcome


def report(folder: Path, slowest: int = 15) -> str:
    lines, every = [], {}
    for path in sorted(folder.glob("*.tsv")):
        wall, seconds, outcome = read_times(path)
        tier = path.name.removesuffix(".tsv")
        passed = sum(1 for o in outcome.values() if o == "passed")
        when = "did not finish" if wall is None else f"{wall / 60:.1f} min ({wall:.0f} s)"
        lines.append(f"{tier:<24} {when:>18}  {len(seconds)} tests, {passed} passed, "
                     f"{sum(seconds.values()):.0f} s in tests")  # fmt: skip
        every.update({f"{nodeid}  [{tier}]": s for nodeid, s in seconds.items()})
    lines.append(f"\nthe {slowest} slowest tests (setup + call + teardown, s):")
    for nodeid, s in sorted(every.items(), key=lambda kv: -kv[1])[:slowest]:
        lines.append(f"{s:8.1f}  {nodeid}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--slowest", type=int, default=15)
    args = parser.parse_args()
    print(report(args.folder, args.slowest))


if __name__ == "__main__":
    main()
