"""Session-wide test settings.

The integration tests leave native threads behind in the test process (DeepSpeed's process
group, which it keeps for the session; Ray's core worker), and the interpreter's teardown once
crashed on one of them with SIGSEGV after every test had passed (exit status 139, seen once in
several runs of tests/test_golden_schedule.py with the learner tests). The session's result is
known by then: the process leaves with it at once instead of tearing those threads down.
"""

from __future__ import annotations

import os
import sys

_status: dict[str, int] = {}


def pytest_sessionfinish(session, exitstatus):
    _status["exit"] = int(exitstatus)


def pytest_unconfigure(config):
    if "exit" in _status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status["exit"])
