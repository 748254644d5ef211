"""A test session with integration tests does not start while a study run or a benchmark holds
the machine's CPU lock (tests/conftest.py), and a unit-tier session never asks for it."""

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
