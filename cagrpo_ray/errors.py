"""What the command line does with an error a run raises, decided by the error's class.

- `UserError`: bad input found once the run looks at it (a prompt file, a policy path, a
  placement, a plan, a tracker, a reward function): one line and exit status 2, no traceback.
- `StoppedWithCheckpoint`: the run stopped on purpose with its last checkpoint intact (dynamic
  sampling found no signal, a learner rank was lost too often): one line and exit status 1.

Anything else is a bug or a fault: its traceback, the log file of the actor it came from, and
exit status 1 (`run.py`). An error class of any layer takes one of these as a second base.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message says what to change (exit status 2, no traceback)."""


class StoppedWithCheckpoint(Exception):
    """The run stopped on purpose, its checkpoint intact (exit status 1, no traceback)."""
