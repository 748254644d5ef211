"""A test session with integration tests does not start while a study run or a benchmark holds
the machine's CPU lock (tests/conftest.py), and a unit-tier session never asks for it; the
`beside` tests of a session run under its lock, in a second process (`--beside`)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def collect(lock: Path, *args: str) -> subprocess.CompletedProcess:
    """Collect (not run) the Ray-job test, an integration test, under the lock file `lock`."""
    env = dict(os.environ, CAGRPO_CPU_LOCK=str(lock))
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
         str(TESTS / "test_ray_job.py"), *args],
        env=env, capture_output=True, text=True, timeout=120, cwd=TESTS.parent,
    )  # fmt: skip


def test_integration_tests_wait_for_a_held_lock_and_take_a_free_one(tmp_path):
    lock = tmp_path / "cpu.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as `flock` does for a study run
        held = collect(lock)
        assert held.returncode == 3, held.stdout + held.stderr
        assert f"{lock} is held" in held.stdout + held.stderr
        assert "pytest -m unit" in held.stdout + held.stderr
        unit_only = collect(lock, "-m", "unit")  # no integration test selected: no lock needed
        assert unit_only.returncode == 5, unit_only.stdout + unit_only.stderr  # none collected
    finally:
        os.close(fd)
    free = collect(lock)
    assert free.returncode == 0, free.stdout + free.stderr
    assert "test_stop_then_resume_as_jobs_with_prometheus_watching" in free.stdout


BESIDE_TESTS = """
import os
from pathlib import Path

import pytest


@pytest.mark.integration
def test_here():
    Path("here.txt").write_text(f"{os.getpid()} {os.nice(0)}")
    with open("order.txt", "a") as order:
        print("here", file=order)


@pytest.mark.integration
@pytest.mark.early
def test_early():
    with open("order.txt", "a") as order:
        print("early", file=order)


@pytest.mark.integration
@pytest.mark.beside
@pytest.mark.parametrize("case", ["a", "b"])
def test_beside(case):
    autogroup = Path("/proc/self/autogroup")
    group = autogroup.read_text().split()[-1] if autogroup.exists() else "-"
    Path(f"beside-{case}.txt").write_text(f"{os.getpid()} {os.nice(0)} {group}")
    assert not (case == "b" and os.environ.get("FAIL_BESIDE")), "case b fails when asked"
"""


@pytest.mark.parametrize("fail", [False, True], ids=["passing", "failing"])
def test_beside_tests_run_in_a_second_niced_process_and_their_failure_fails_the_session(
    tmp_path, fail
):
    """`--beside` (tests/conftest.py): the `beside` tests run in one other process at nice 19,
    in a session whose autogroup has nice 19 too where the kernel has autogroups
    (tests/lowest_priority.py), under the session's CPU lock, and a failure there is the
    session's failure, in full; the `early` tests run first in the session's own process."""
    for name in ("conftest.py", "lowest_priority.py"):
        (tmp_path / name).write_text((TESTS / name).read_text())
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    unit\n    integration\n    preset\n    early\n    beside\n"
    )
    (tmp_path / "test_sample.py").write_text(BESIDE_TESTS)
    env = dict(os.environ, CAGRPO_CPU_LOCK=str(tmp_path / "cpu.lock"))
    env.pop("PYTEST_ADDOPTS", None)
    if fail:
        env["FAIL_BESIDE"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--beside", "."],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    out = run.stdout + run.stderr
    here = (tmp_path / "here.txt").read_text().split()
    beside = {c: (tmp_path / f"beside-{c}.txt").read_text().split() for c in "ab"}
    assert beside["a"][0] == beside["b"][0] != here[0], out  # one other process for both
    assert int(beside["a"][1]) == 19, out
    if Path("/proc/self/autogroup").exists():  # the session's autogroup: lowered too
        assert beside["a"][2] == "19", out
    assert "2 passed, 2 deselected" in out
    assert (tmp_path / "order.txt").read_text().split() == ["early", "here"], out
    log = (tmp_path / "runs" / "tests-beside.log").read_text()
    if fail:
        assert run.returncode == 1, out
        assert "the 2 tests run beside (--beside): FAILED" in out
        assert "case b fails when asked" in out and "1 failed, 1 passed" in log
    else:
        assert run.returncode == 0, out
        assert "the 2 tests run beside (--beside): passed" in out and "2 passed" in log
