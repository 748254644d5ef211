"""Prompt groups to generate again, under the group ids they were started with.

A chunk of prompt groups is lost when its generator replica dies (or, on resume, when it was
still in flight at the checkpoint). Its groups are generated again under their own group ids,
so with the same seeds (a group's seed derives from its chunk's first group id and its place
in the chunk, `Schedule.start_chunk` in cagrpo_ray/schedule.py): the run after a lost replica
trains the groups, prompts and seeds of the uninterrupted run. Only a chunk that must be
split (less room under the staleness bound than its size, which a lost chunk hardly meets
since its groups stopped counting as outstanding) gives its tail other seeds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptChunk:
    """The label of a chunk in flight: which training prompts, as which groups."""

    indices: tuple[int, ...]  # into the training source
    group_ids: tuple[int, ...]  # one per prompt, in start order


class Requeue:
    """Chunks waiting to be generated again, first group id first."""

    def __init__(self, chunks: list[PromptChunk] | None = None):
        self._chunks = sorted(chunks or [], key=lambda c: c.group_ids[0])

    def __len__(self) -> int:
        return len(self._chunks)

    def push(self, chunk: PromptChunk) -> None:
        self._chunks.append(chunk)
        self._chunks.sort(key=lambda c: c.group_ids[0])

    def take(self, count: int) -> PromptChunk:
        """The next waiting chunk whole, or its first `count` groups (the rest waits)."""
        chunk = self._chunks.pop(0)
        if len(chunk.indices) > count:
            rest = PromptChunk(chunk.indices[count:], chunk.group_ids[count:])
            self._chunks.insert(0, rest)
            chunk = PromptChunk(chunk.indices[:count], chunk.group_ids[:count])
        return chunk

    def state(self, pending: list[PromptChunk]) -> list[list[list[int]]]:
        """[[indices, group ids], ...]: the waiting chunks and `pending` (started, not buffered)."""
        every = sorted([*self._chunks, *pending], key=lambda c: c.group_ids[0])
        return [[list(c.indices), list(c.group_ids)] for c in every]

    @classmethod
    def from_state(cls, entries: list) -> Requeue:
        """The requeue of a checkpoint (`state`'s [[indices, group ids], ...])."""
        return cls([PromptChunk(tuple(indices), tuple(ids)) for indices, ids in entries])
