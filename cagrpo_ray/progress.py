"""Progress of long work: a live bar on a terminal, sparse plain lines in a log file.

A carriage-return progress bar written into a log (a Ray job's, CI's, `make train > log`)
becomes hundreds of frames on one line; when the stream is not a terminal, `Progress` prints
one line at most every `every_s` seconds or tenth of the work instead.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Progress over `total` steps of `desc`; `update(**postfix)` after each step, then
    `close()`. Disabled (`enabled=False`) it prints nothing."""

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        unit: str = "step",
        enabled: bool = True,
        stream: TextIO | None = None,
        every_s: float = 30.0,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.every_s = every_s
        self.done = 0
        self._start = self._last_time = time.monotonic()
        self._last_fraction = 0.0
        self._bar = None
        if enabled and _is_terminal(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream)

    def update(self, n: int = 1, **postfix) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            return
        now = time.monotonic()
        fraction = self.done / max(self.total, 1)
        if now - self._last_time >= self.every_s or fraction - self._last_fraction >= 0.1:
            self._line(now, postfix)
            self._last_time, self._last_fraction = now, fraction

    def close(self, **postfix) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.close()
        elif self.enabled:
            self._line(time.monotonic(), postfix)

    def _line(self, now: float, postfix: dict) -> None:
        elapsed = now - self._start
        extra = "".join(f" {k}={v}" for k, v in postfix.items())
        print(
            f"{self.desc}: {self.done}/{self.total} {self.unit}s ({elapsed:.0f} s){extra}",
            file=self.stream,
            flush=True,
        )


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
