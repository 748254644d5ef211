"""Prompts read from a local Parquet or JSONL file, as MATH-500, AIME24, GSM8K and Open-RS ship.

Rows are located as the user would look them up: "line N" (1-based) in a JSONL file, "row N"
(0-based, as pyarrow and pandas count) in a Parquet file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from cagrpo_ray.data.types import IndexedSource, PromptItem

log = logging.getLogger(__name__)

QUESTION_COLUMNS = ("problem", "prompt", "question")


class PromptFileError(ValueError):
    """A prompt file that cannot be read as prompts; the message names the file."""


class BadRowError(PromptFileError):
    """A row that cannot become a prompt; the message names the file and the row."""


@dataclass(frozen=True)
class BadRow:
    path: str
    location: str  # "line 7" (JSONL, 1-based) or "row 6" (Parquet, 0-based)
    reason: str

    def __str__(self) -> str:
        return f"{self.path}, {self.location}: {self.reason}"


class FilePromptSource(IndexedSource):
    """The prompts of a `.parquet` or `.jsonl` file, in file order.

    Args:
        path: the file; `.parquet` or `.jsonl` (also `.json` holding one object per line).
        question_column: column with the problem text; None picks the first of "problem",
            "prompt", "question" that the file has.
        answer_column: column with the reference answer, which must be a string.
        on_bad_row: "skip" drops a bad row (missing column, empty question, non-string
            answer, unreadable JSON line), counts it and logs the count with the first few
            locations; "error" raises `BadRowError` naming the file and row.

    Item uid is "<file name>:<row index>" with the Parquet row or the 0-based JSONL line; the
    metadata holds the row's other columns and "source_file".
    """

    def __init__(
        self,
        path: str | Path,
        question_column: str | None = None,
        answer_column: str = "answer",
        on_bad_row: str = "skip",
    ):
        if on_bad_row not in ("skip", "error"):
            raise ValueError(f"on_bad_row must be 'skip' or 'error', not {on_bad_row!r}")
        self.path = Path(path)
        self.answer_column = answer_column
        self.on_bad_row = on_bad_row
        rows = list(self._read_rows())
        self.question_column = question_column or self._detect_question_column(rows)
        self.bad_rows: list[BadRow] = []
        self._items = []
        for index, location, row in rows:
            item = self._item(index, location, row)
            if item is not None:
                self._items.append(item)
        if self.bad_rows:
            shown = "; ".join(str(bad) for bad in self.bad_rows[:3])
            log.warning(
                "skipped %d bad rows of %d in %s (first: %s)",
                len(self.bad_rows),
                len(rows),
                self.path,
                shown,
            )

    @property
    def skipped(self) -> int:
        """How many rows were skipped as bad."""
        return len(self.bad_rows)

    def _read_rows(self) -> Iterator[tuple[int, str, dict[str, Any] | BadRow]]:
        """(row index, location, row) for each row; an unreadable row comes as a `BadRow`."""
        if not self.path.is_file():
            raise PromptFileError(f"prompt file {self.path} does not exist")
        suffix = self.path.suffix.lower()
        if suffix == ".parquet":
            for index, row in enumerate(pq.read_table(self.path).to_pylist()):
                yield index, f"row {index}", row
        elif suffix in (".jsonl", ".json"):
            with self.path.open(encoding="utf-8") as lines:
                for index, line in enumerate(lines):
                    location = f"line {index + 1}"
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as error:
                        yield (
                            index,
                            location,
                            BadRow(str(self.path), location, f"not JSON: {error}"),
                        )
                        continue
                    if not isinstance(row, dict):
                        reason = f"a JSON {type(row).__name__}, not an object"
                        yield index, location, BadRow(str(self.path), location, reason)
                        continue
                    yield index, location, row
        else:
            raise PromptFileError(f"prompt file {self.path} is not .parquet or .jsonl")

    def _detect_question_column(self, rows) -> str:
        columns = set().union(*(row.keys() for _, _, row in rows if isinstance(row, dict)))
        for name in QUESTION_COLUMNS:
            if name in columns:
                return name
        raise PromptFileError(
            f"{self.path} has none of the question columns {QUESTION_COLUMNS}; its columns are "
            f"{sorted(columns)}; pass question_column"
        )

    def _item(self, index: int, location: str, row: dict | BadRow) -> PromptItem | None:
        bad = row if isinstance(row, BadRow) else self._check(location, row)
        if bad is not None:
            if self.on_bad_row == "error":
                raise BadRowError(str(bad))
            self.bad_rows.append(bad)
            return None
        metadata = {
            key: value
            for key, value in row.items()
            if key not in (self.question_column, self.answer_column)
        }
        metadata["source_file"] = self.path.name
        return PromptItem(
            uid=f"{self.path.name}:{index}",
            question=row[self.question_column],
            answer=row[self.answer_column],
            metadata=metadata,
        )

    def _check(self, location: str, row: dict) -> BadRow | None:
        def bad(reason: str) -> BadRow:
            return BadRow(str(self.path), location, reason)

        for column in (self.question_column, self.answer_column):
            if column not in row:
                return bad(f"no column {column!r} (columns: {sorted(row)})")
        question, answer = row[self.question_column], row[self.answer_column]
        if not isinstance(question, str):
            return bad(f"question {self.question_column!r} is {type(question).__name__}, not str")
        if not question.strip():
            return bad(f"question {self.question_column!r} is empty")
        if not isinstance(answer, str):
            return bad(f"answer {self.answer_column!r} is {type(answer).__name__}, not str")
        return None
