"""Prompts read from a local Parquet or JSONL file, or a Hugging Face `datasets` folder, in the
layouts that verl, TRL and OpenRLHF users already have.

Layouts (`format`; "auto" detects one from the columns, in this order):

- `verl`: a `prompt` column of chat messages and a `reward_model` column whose `ground_truth`
  is the answer (what verl's `examples/data_preprocess/*.py` write); `data_source`, `ability`
  and `extra_info` stay in the item for the reward function.
- `openrlhf`: `input` (text or messages) and `label` columns (OpenRLHF's `--input_key input
  --label_key label`).
- `trl`: a `prompt` column, text (TRL's standard layout) or chat messages (conversational);
  the answer column is named by `answer_column`.
- `plain`: a `problem`, `prompt` or `question` column and an `answer` column, as MATH-500,
  AIME24 and GSM8K ship.

A prompt is either text, which the run's instruction and the chat template wrap
(`data/prompts.py`), or a list of chat messages, which the chat template renders as they are.
Columns may be dotted paths into nested ones (`reward_model.ground_truth`). Every column but
the question's stays in the item's metadata: the reward functions receive them (TRL passes
each as a keyword argument). Rows are located as the user would look them up: "line N"
(1-based) in a JSONL file, "row N" (0-based, as pyarrow, pandas and `datasets` count) in a
Parquet file or a `datasets` folder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from cagrpo_ray.data.prompts import check_prompt_lengths, prompt_preamble
from cagrpo_ray.data.types import IndexedSource, PromptItem
from cagrpo_ray.errors import UserError

log = logging.getLogger(__name__)

QUESTION_COLUMNS = ("problem", "prompt", "question")
FORMATS = ("auto", "plain", "verl", "trl", "openrlhf")
# format -> (question column or None to pick one of QUESTION_COLUMNS, answer column)
LAYOUT_COLUMNS: dict[str, tuple[str | None, str]] = {
    "plain": (None, "answer"),
    "verl": ("prompt", "reward_model.ground_truth"),
    "trl": ("prompt", "answer"),
    "openrlhf": ("input", "label"),
}
CHAT_ROLES = ("system", "user", "assistant", "tool")


class PromptFileError(UserError, ValueError):
    """A prompt file that cannot be read as prompts; the message names the file."""


class BadRowError(PromptFileError):
    """A row that cannot become a prompt; the message names the file and the row."""


@dataclass(frozen=True)
class BadRow:
    path: str
    location: str  # "line 7" (JSONL, 1-based) or "row 6" (Parquet, datasets; 0-based)
    reason: str

    def __str__(self) -> str:
        return f"{self.path}, {self.location}: {self.reason}"


def detect_format(columns: set[str]) -> str:
    """The layout that `columns` (a file's top-level column names) are written in."""
    if {"prompt", "reward_model"} <= columns:
        return "verl"
    if {"input", "label"} <= columns:
        return "openrlhf"
    if "prompt" in columns and "problem" not in columns:  # "problem" first, as before
        return "trl"
    return "plain"


def column_value(row: dict[str, Any], column: str) -> Any:
    """`row[column]`, where a dotted `column` not present as such walks nested mappings
    (`reward_model.ground_truth`); raises KeyError naming the first missing part."""
    if column in row:
        return row[column]
    value: Any = row
    for depth, part in enumerate(column.split(".")):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(".".join(column.split(".")[: depth + 1]))
        value = value[part]
    return value


def chat_messages_problem(value: Any) -> str | None:
    """Why `value` is not a list of chat messages ({role, content: text}), or None if it is."""
    if not isinstance(value, list) or not value:
        return "not a non-empty list of chat messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            return f"message {i} is {message!r}, not {{role, content}}"
        if message["role"] not in CHAT_ROLES:
            return f"message {i} has role {message['role']!r}; roles: {', '.join(CHAT_ROLES)}"
        if not isinstance(message["content"], str):
            return f"message {i}'s content is {type(message['content']).__name__}, not str"
    if not any(message["content"].strip() for message in value):
        return "every message is empty"
    return None


class FilePromptSource(IndexedSource):
    """The prompts of a `.parquet` or `.jsonl` file or a `datasets` folder, in row order.

    Args:
        path: a `.parquet` or `.jsonl` (also `.json` holding one object per line) file, or a
            folder written by `datasets.Dataset.save_to_disk` (for a `DatasetDict`, the
            folder of one split, e.g. `gsm8k/train`).
        question_column: column with the prompt (text or chat messages); None: the layout's
            (`prompt` for verl and TRL, `input` for OpenRLHF, else the first of "problem",
            "prompt", "question" that the file has). A dotted path reaches a nested column.
        answer_column: column with the reference answer, which must be a string; None: the
            layout's (`reward_model.ground_truth` for verl, `label` for OpenRLHF, else
            `answer`).
        on_bad_row: "skip" drops a bad row (missing column, empty question, non-string
            answer, unreadable JSON line), counts it and logs the count with the first few
            locations; "error" raises `BadRowError` naming the file and row.
        format: the layout, one of `FORMATS`; "auto" detects it from the columns.

    Item uid is "<file name>:<row index>" with the row or the 0-based JSONL line; the metadata
    holds every column but the question's, and "source_file".
    """

    def __init__(
        self,
        path: str | Path,
        question_column: str | None = None,
        answer_column: str | None = None,
        on_bad_row: str = "skip",
        format: str = "auto",
    ):
        if on_bad_row not in ("skip", "error"):
            raise ValueError(f"on_bad_row must be 'skip' or 'error', not {on_bad_row!r}")
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
        self.path = Path(path)
        self.on_bad_row = on_bad_row
        rows = list(self._read_rows())
        columns = set().union(*(row.keys() for _, _, row in rows if isinstance(row, dict)))
        self.format = detect_format(columns) if format == "auto" else format
        layout_question, layout_answer = LAYOUT_COLUMNS[self.format]
        self.question_column = (
            question_column or layout_question or self._detect_question_column(columns)
        )
        self.answer_column = answer_column or layout_answer
        self.bad_rows: list[BadRow] = []
        self._items = []
        self._locations: dict[str, str] = {}  # uid -> "line 7" / "row 6"
        for index, location, row in rows:
            item = self._item(index, location, row)
            if item is not None:
                self._items.append(item)
                self._locations[item.uid] = location
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

    def where(self, item: PromptItem) -> str:
        """Where `item` came from, as a user finds it: "<path>, line 7" or "<path>, row 6"."""
        return f"{self.path}, {self._locations[item.uid]}"

    def _read_rows(self) -> Iterator[tuple[int, str, dict[str, Any] | BadRow]]:
        """(row index, location, row) for each row; an unreadable row comes as a `BadRow`."""
        if self.path.is_dir():
            yield from self._read_dataset_folder()
            return
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
            raise PromptFileError(
                f"prompt file {self.path} is not .parquet or .jsonl, nor a datasets folder"
            )

    def _read_dataset_folder(self) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """The rows of a folder written by `save_to_disk`, read by the `datasets` library."""
        try:
            import datasets
        except ImportError as error:  # the `data` extra
            raise PromptFileError(
                f"{self.path} is a folder: reading a datasets folder needs the `datasets` "
                "package (pip install 'cagrpo-ray[data]')"
            ) from error
        try:
            dataset = datasets.load_from_disk(str(self.path))
        except FileNotFoundError as error:
            raise PromptFileError(
                f"{self.path} is a folder but not one that datasets.save_to_disk wrote: {error}"
            ) from error
        if isinstance(dataset, datasets.DatasetDict):
            splits = ", ".join(f"{self.path / name}" for name in dataset)
            raise PromptFileError(
                f"{self.path} holds several splits; name the folder of one: {splits}"
            )
        for index, row in enumerate(dataset):
            yield index, f"row {index}", row

    def _detect_question_column(self, columns: set[str]) -> str:
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
        question = column_value(row, self.question_column)
        if isinstance(question, list):  # only role and content reach the chat template
            question = [{"role": m["role"], "content": m["content"]} for m in question]
        metadata = {key: value for key, value in row.items() if key != self.question_column}
        metadata["source_file"] = self.path.name
        return PromptItem(
            uid=f"{self.path.name}:{index}",
            question=question,
            answer=column_value(row, self.answer_column),
            metadata=metadata,
        )

    def _check(self, location: str, row: dict) -> BadRow | None:
        def bad(reason: str) -> BadRow:
            return BadRow(str(self.path), location, reason)

        values = {}
        for column in (self.question_column, self.answer_column):
            try:
                values[column] = column_value(row, column)
            except KeyError as missing:
                return bad(f"no column {missing.args[0]!r} (columns: {sorted(row)})")
        question, answer = values[self.question_column], values[self.answer_column]
        if isinstance(question, list):
            problem = chat_messages_problem(question)
            if problem is not None:
                return bad(f"question {self.question_column!r}: {problem}")
        elif not isinstance(question, str):
            return bad(
                f"question {self.question_column!r} is {type(question).__name__}, not str or "
                "a list of chat messages"
            )
        elif not question.strip():
            return bad(f"question {self.question_column!r} is empty")
        if not isinstance(answer, str):
            return bad(f"answer {self.answer_column!r} is {type(answer).__name__}, not str")
        return None


def file_sources(data, tokenizer, max_model_len: int) -> tuple[FilePromptSource, list[PromptItem]]:
    """The training source and the held-out items (the first `data.eval_size`) that a run's
    `data` config section names, each prompt checked to fit `max_model_len` tokens with
    `tokenizer`'s chat template (`check_prompt_lengths`)."""
    options = dict(
        question_column=data.question_column,
        answer_column=data.answer_column,
        on_bad_row=data.on_bad_row,
        format=data.format,
    )
    train = FilePromptSource(data.path, **options)
    held_out = FilePromptSource(data.eval_path, **options)
    eval_items = list(held_out.iter_from(0))[: data.eval_size]
    preamble = prompt_preamble(data)
    for source, items in ((train, train), (held_out, eval_items)):
        check_prompt_lengths(items, tokenizer, preamble, max_model_len, source.where)
    return train, eval_items
