"""Per-step metrics as JSON lines: one object per learner step, appended and flushed."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None keeps the key visible
    return value


class MetricsLog:
    """Append-only JSONL file of per-step metric dicts (`step` is always present)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps > `step` (a resumed run rewrites what came after its checkpoint)."""
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", -1) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        if "step" not in record:
            raise ValueError("a metrics record needs a 'step'")
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        with self.path.open("a") as f:
            f.write(line + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
