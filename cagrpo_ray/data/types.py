"""The prompt record and the protocol every prompt source follows."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class PromptItem:
    """One task prompt, before any chat template is applied."""

    uid: str  # stable id, e.g. "chain_sum:train:123" or "math500.jsonl:17"
    question: str | list[dict]  # problem text, or chat messages (role, content); no template
    answer: str  # reference answer as a string
    metadata: dict[str, Any] = field(default_factory=dict)
    # for reasoning_gym the dataset entry's metadata, which carries "source_dataset" so that
    # the verifier can find the dataset's score_answer


@runtime_checkable
class PromptSource(Protocol):
    """An indexable, finite sequence of prompts in a fixed order.

    The order depends only on the source's arguments, so a trainer that checkpoints the index of
    the next prompt (its data cursor) resumes with `iter_from(cursor)` and neither skips nor
    replays a prompt.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PromptItem: ...

    def iter_from(self, cursor: int = 0) -> Iterator[PromptItem]:
        """Items `cursor`, `cursor + 1`, ..., `len(self) - 1`."""
        ...


class IndexedSource:
    """Shared `iter_from` and bounds checking for sources that hold their items in a list."""

    _items: list[PromptItem]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> PromptItem:
        if not -len(self._items) <= index < len(self._items):
            raise IndexError(f"prompt index {index} is outside 0..{len(self._items) - 1}")
        return self._items[index]

    def iter_from(self, cursor: int = 0) -> Iterator[PromptItem]:
        if not 0 <= cursor <= len(self._items):
            raise IndexError(f"data cursor {cursor} is outside 0..{len(self._items)}")
        return iter(self._items[cursor:])
