"""Reward errors a user can read: which function failed, on which sample, and why.

A reward function or verifier that raises, times out or returns something that is not a
finite number scores 0 (or stops the run with `reward.on_error: raise`) and counts in
`reward/verifier_errors`. `RewardErrorLog` also says what happened:

- the first error of each kind (the same function and message, whatever the sample and the
  numbers in it) is a console warning naming the function, the sample (its uid, which names
  the dataset row, and its index in the training prompts) and the message;
- every `report_every` learner steps with errors, one line counts them (and their kinds);
- every error goes, with its sample and the response, to `logs/reward_errors.jsonl` in the
  run directory (one JSON object a line: the learner step under way, uid, prompt index, group
  id, response index, error, response text).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger("cagrpo_ray")

ERRORS_FILE = "reward_errors.jsonl"  # in the run's logs/ folder
_SAMPLE = re.compile(r" on sample '[^']*'")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def error_kind(error: str) -> str:
    """What two errors share when they are the same failure: the message without its sample
    and with every number blanked."""
    return _NUMBER.sub("#", _SAMPLE.sub("", error))[:200]


def read_errors(path: str | Path) -> dict[tuple[int, int], str]:
    """(group id, response index) -> the reward error of that response, from a run's
    `reward_errors.jsonl` (empty when there is none): what the token inspector marks."""
    path = Path(path)
    if not path.is_file():
        return {}
    errors = {}
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            errors[(int(entry["group_id"]), int(entry["response_index"]))] = str(entry["error"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a run that was killed while writing it
    return errors


class RewardErrorLog:
    """The reward errors of one run (module docstring); `path` None keeps no file."""

    def __init__(self, path: str | Path | None, report_every: int = 10):
        self.path = Path(path) if path is not None else None
        self.report_every = report_every
        self.kinds: dict[str, int] = {}  # kind -> errors of that kind, over the run
        self.total = 0
        self._since_report = 0
        self._kinds_since_report: set[str] = set()
        self._last_report_step = 0

    def record(
        self,
        step: int,
        error: str,
        uid: str,
        prompt_index: int,
        group_id: int,
        response_index: int,
        response: str,
    ) -> None:
        """One scored response whose reward had `error`, scored while learner step `step` was
        under way (waited for or trained)."""
        kind = error_kind(error)
        first = kind not in self.kinds
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.total += 1
        self._since_report += 1
        self._kinds_since_report.add(kind)
        if first:
            where = f" (every reward error is in {self.path})" if self.path else ""
            log.warning(
                "reward error, the first of its kind%s: on sample %r (training prompt %d, "
                "group %d, response %d): %s",
                where,
                uid,
                prompt_index,
                group_id,
                response_index,
                _SAMPLE.sub("", error),
            )
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entry = {
                "step": step,
                "uid": uid,
                "prompt_index": prompt_index,
                "group_id": group_id,
                "response_index": response_index,
                "error": error,
                "response": response,
            }
            with self.path.open("a") as out:
                out.write(json.dumps(entry) + "\n")

    def step_done(self, step: int) -> None:
        """Learner step `step` ended: every `report_every` steps, count the errors since."""
        if step - self._last_report_step < self.report_every:
            return
        if self._since_report:
            log.warning(
                "reward errors: %d in steps %d-%d (%d kind%s; %d in the run)%s",
                self._since_report,
                self._last_report_step + 1,
                step,
                len(self._kinds_since_report),
                "" if len(self._kinds_since_report) == 1 else "s",
                self.total,
                f", each in {self.path}" if self.path else "",
            )
        self._since_report, self._kinds_since_report = 0, set()
        self._last_report_step = step
