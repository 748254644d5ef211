"""When a lost learner rank is recovered inside the job, and when the run stops instead.

A learner rank whose process is gone (killed, out of memory, its node lost) takes the whole
data-parallel group down: DeepSpeed's process group cannot be repaired one rank at a time, so
`LearnerGroup` stops every rank and raises `LearnerGroupError` with `lost` set. The trainer
then builds a new group from the latest checkpoint and goes on (`Trainer._recover_learners`),
at most `run.max_restarts` times in one job; the loss after that stops the run with
`LearnerLostError`, its checkpoint intact. A rank that raised an error (a bug, a bad batch)
is not recovered: the same step would fail the same way again.
"""

from __future__ import annotations

from cagrpo_ray.errors import StoppedWithCheckpoint
from cagrpo_ray.learner.group import LearnerGroupError


class LearnerLostError(StoppedWithCheckpoint, RuntimeError):
    """A learner rank was lost once more than `run.max_restarts` allows: the run stops."""


class LearnerRestarts:
    """The recoveries of the learner group in this job, against `max_restarts`."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.count = 0  # recoveries made so far

    def admit(self, error: LearnerGroupError, step: int, checkpoint: str | None) -> None:
        """Count one recovery from `error`, raised after learner step `step`, or raise
        when the run must stop instead: `error` itself when no rank's process died
        (nothing a new group would cure), `LearnerLostError` once `max_restarts` recoveries
        were made. `checkpoint`: the name of the checkpoint the run would resume from (None
        before the first), for the message."""
        if not error.lost:
            raise error
        if self.count >= self.max_restarts:
            kept = (
                f"its latest checkpoint, {checkpoint}, is intact (`--resume auto` continues "
                "from it)"
                if checkpoint
                else "it has no checkpoint yet"
            )
            spent = (
                f"the learner group was already rebuilt {self.count} "
                f"time{'s' * (self.count != 1)} in this job, as often as run.max_restarts "
                f"({self.max_restarts}) allows"
                if self.count
                else "run.max_restarts is 0"
            )
            raise LearnerLostError(
                f"learner rank {error.rank} was lost after step {step}; {spent}, so the run "
                f"stops, and {kept}. {error}"
            ) from error
        self.count += 1
