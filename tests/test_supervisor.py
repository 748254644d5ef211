"""The command's outer process ends what the run left: a process orphaned under it (here one
that ignores SIGTERM, as a stuck engine might) is re-parented to it, not to init, and is
killed once the grace period has passed. tests/test_run_exits.py runs the whole command."""

from __future__ import annotations

import subprocess
import sys

import pytest

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]

SCRIPT = """
import os, subprocess, sys, time
import psutil
from cagrpo_ray.supervisor import _PR_SET_CHILD_SUBREAPER, _prctl, end_leftovers
_prctl(_PR_SET_CHILD_SUBREAPER, 1)
# a child that starts a grandchild ignoring SIGTERM, then exits: the grandchild is orphaned
subprocess.run([sys.executable, "-c",
    "import signal, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])"],
    check=True)
[orphan] = psutil.Process().children()
start = time.monotonic()
named = end_leftovers(settle_s=0.5, grace_s=1.0)
print(len(named), orphan.is_running(), time.monotonic() - start < 10)
"""


def test_an_orphan_that_ignores_sigterm_is_reparented_here_and_killed():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["1", "False", "True"], done.stdout + done.stderr
    assert "ending what the run left running:" in done.stderr


AGENT_SCRIPT = """
import subprocess, sys, time
import psutil
from cagrpo_ray.supervisor import _PR_SET_CHILD_SUBREAPER, _prctl, end_leftovers
_prctl(_PR_SET_CHILD_SUBREAPER, 1)
# an orphan titled as Ray's dashboard agent (argv[0]), ignoring SIGTERM as the real one does
# once its raylet is gone
subprocess.run([sys.executable, "-c",
    "import subprocess, sys; subprocess.Popen(['ray::DashboardAgent', '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'], "
    "executable=sys.executable)"],
    check=True)
[agent] = psutil.Process().children()
assert agent.cmdline()[0] == "ray::DashboardAgent", agent.cmdline()
start = time.monotonic()
named = end_leftovers(settle_s=20.0, grace_s=20.0)
print(len(named), agent.is_running(), f"{time.monotonic() - start:.1f}")
"""


def test_rays_agents_left_by_a_killed_driver_are_killed_at_once():
    done = subprocess.run(
        [sys.executable, "-c", AGENT_SCRIPT], capture_output=True, text=True, timeout=60,
        check=True,
    )  # fmt: skip
    count, running, seconds = done.stdout.split()
    # not named (nothing of the run is in them), gone, and neither period waited for
    assert (count, running) == ("0", "False"), done.stdout + done.stderr
    assert float(seconds) < 10, done.stdout
