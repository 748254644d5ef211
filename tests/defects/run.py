"""Apply each deliberate defect in a scratch copy of the tree and run the tests that must catch it.

    .venv/bin/python tests/defects/run.py                 # every defect, in order
    .venv/bin/python tests/defects/run.py 03 07           # the defects whose names start so
    .venv/bin/python tests/defects/run.py --list          # what each breaks and who catches it
    make defects                                          # the same as the first line

Each `tests/defects/NN-name.patch` is a small change to the package that breaks one behaviour,
in `git diff` form, after a header that `git apply` ignores:

    Defect: a resumed run re-reads the data cursor from the wrong step
    Catch: tests/test_train.py::test_resume_with_a_killed_generator[bound1]
    Catch: tests/test_chaos.py

The `Catch:` lines are pytest node ids (a module, a test, a parametrized case). For each
defect the script copies the working tree (tracked and untracked files that git does not
ignore, so a change not yet committed is what gets broken) into a scratch folder, applies the
patch there, checks that `cagrpo_ray` imports from the copy (`PYTHONPATH`: the copy's package
shadows the editable install, in the test process and in every process it starts), and runs
pytest on the `Catch:` ids. A defect is **caught** when pytest reports a failed test (exit
status 1), **missed** when every test passed, and an **error** otherwise (the patch does not
apply, nothing was collected, the collection failed): an error proves nothing either way.
By default pytest stops at the first failure (`-x`), which is all "caught" needs; `--all`
runs every `Catch:` test to list each one that fails.

A table (defect, verdict, the failed tests, seconds) is printed and written to
`runs/defects/<time>.md` with the commit it ran on. Not run by CI: each defect costs the
minutes of the integration tests that catch it; run it before and after any change that
shortens, merges or moves tests, and compare the tables.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@dataclass
class Defect:
    path: Path
    summary: str
    catch: list[str]

    @property
    def name(self) -> str:
        return self.path.stem


@dataclass
class Outcome:
    defect: Defect
    verdict: str  # caught, missed, error
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    detail: str = ""


def read_defect(path: Path) -> Defect:
    """The header of `path`: its `Defect:` line and its `Catch:` node ids."""
    summary, catch = "", []
    for line in path.read_text().splitlines():
        if line.startswith("diff --git"):
            break
        if line.startswith("Defect:"):
            summary = line.split(":", 1)[1].strip()
        elif line.startswith("Catch:"):
            catch.append(line.split(":", 1)[1].strip())
    if not summary or not catch:
        raise SystemExit(f"{path}: a defect needs a 'Defect:' line and at least one 'Catch:' line")
    return Defect(path, summary, catch)


def all_defects() -> list[Defect]:
    return [read_defect(p) for p in sorted(HERE.glob("*.patch"))]


def copy_tree(dest: Path) -> None:
    """The working tree's files that git tracks or would track, copied to `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    for raw in filter(None, listed):
        rel = raw.decode()
        source = REPO / rel
        if not source.is_file():  # deleted in the working tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.MULTILINE)


def check(defect: Defect, python: str, scratch_root: Path, run_all: bool, log_dir: Path) -> Outcome:
    scratch = scratch_root / defect.name
    copy_tree(scratch)
    applied = subprocess.run(
        ["git", "apply", "--verbose", str(defect.path)], cwd=scratch, capture_output=True, text=True
    )
    if applied.returncode != 0:
        return Outcome(defect, "error", detail=f"does not apply: {applied.stderr.strip()}")
    env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    where = subprocess.run(
        [python, "-c", "import cagrpo_ray; print(cagrpo_ray.__file__)"],
        cwd=scratch, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if not where.stdout.strip().startswith(str(scratch)):
        return Outcome(defect, "error", detail=f"cagrpo_ray imports from {where.stdout.strip()}")
    command = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly"]
    command += ([] if run_all else ["-x"]) + defect.catch
    log = log_dir / f"{defect.name}.log"
    start = time.monotonic()
    with log.open("w") as out:
        status = subprocess.run(command, cwd=scratch, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    text = log.read_text()
    failed = sorted(set(FAILED.findall(text)))
    if status.returncode == 1 and failed:
        return Outcome(defect, "caught", failed, seconds)
    if status.returncode == 0:
        return Outcome(defect, "missed", [], seconds)
    tail = " | ".join(text.strip().splitlines()[-3:])
    return Outcome(defect, "error", failed, seconds, f"pytest exit {status.returncode}: {tail}")


def table(outcomes: list[Outcome]) -> str:
    rows = ["| defect | breaks | verdict | failed tests | s |", "|---|---|---|---|---|"]
    for o in outcomes:
        failed = "<br>".join(o.failed) or o.detail or "-"
        rows.append(f"| {o.defect.name} | {o.defect.summary} | **{o.verdict}** | {failed} | "
                    f"{o.seconds:.0f} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run the defects whose names start with these")
    parser.add_argument("--list", action="store_true", help="list the defects and exit")
    parser.add_argument("--all", action="store_true", help="run every Catch: test, not -x")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with pytest")
    args = parser.parse_args(argv)
    defects = [d for d in all_defects() if not args.names or d.name.startswith(tuple(args.names))]
    if args.list:
        for d in defects:
            print(f"{d.name}: {d.summary}\n    " + "\n    ".join(d.catch))
        return 0
    if not defects:
        print("no defect matches", args.names)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = REPO / "runs" / "defects" / stamp
    log_dir.mkdir(parents=True, exist_ok=True)
    scratch_root = Path(tempfile.mkdtemp(prefix="cagrpo-defects-"))
    outcomes = []
    try:
        for defect in defects:
            print(f"{time.strftime('%H:%M:%S')} {defect.name}: {defect.summary}", flush=True)
            outcome = check(defect, args.python, scratch_root, args.all, log_dir)
            print(f"    {outcome.verdict} in {outcome.seconds:.0f} s "
                  f"{' '.join(outcome.failed) or outcome.detail}", flush=True)  # fmt: skip
            outcomes.append(outcome)
            if not args.keep:
                shutil.rmtree(scratch_root / defect.name, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch_root, ignore_errors=True)
    heading = (f"Deliberate defects on {commit}{' with uncommitted changes' if dirty else ''}, "
               f"{time.strftime('%Y-%m-%d %H:%M')} ({os.uname().nodename}, "
               f"{os.cpu_count()} cores); logs in {log_dir.relative_to(REPO)}")  # fmt: skip
    report = f"{heading}\n\n{table(outcomes)}\n"
    (REPO / "runs" / "defects" / f"{stamp}.md").write_text(report)
    print("\n" + report)
    return 0 if all(o.verdict == "caught" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
