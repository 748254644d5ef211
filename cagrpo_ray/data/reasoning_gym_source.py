"""Prompts drawn from a reasoning_gym procedural dataset, with disjoint train and eval splits.

reasoning_gym seeds item `idx` of a dataset with `seed + idx`, so two datasets whose seeds are
closer than their sizes share items. Each split therefore gets its own seed region, far apart
(`SPLIT_SEED_OFFSETS`), and the eval split also drops every question that the training splits
of the same seed contain (small configs repeat questions within any region) and its own
repeats.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import reasoning_gym

from cagrpo_ray.data.types import IndexedSource, PromptItem

SPLIT_SEED_OFFSETS = {"train": 0, "sft": 100_000_000, "eval": 200_000_000}
TRAINING_SPLITS = ("train", "sft")


def generate_entries(name: str, config: dict[str, Any], seed: int, size: int) -> list[dict]:
    """`size` entries of the reasoning_gym dataset `name` built with `config` and `seed`."""
    if size <= 0:
        return []
    dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    return [dataset[i] for i in range(size)]


def split_questions(name: str, config: dict[str, Any], seed: int, size: int) -> frozenset[str]:
    """The questions of `generate_entries(name, config, seed, size)`, kept for the next call
    with the same arguments: every run of a process (a sweep, the tests) excludes the same
    training splits from its held-out prompts, and drawing them again took ~2 s a run for
    chain_sum's 20,000 + 64,000 and ~5 s for basic_arithmetic's 20,000."""
    return _split_questions(name, json.dumps(config, sort_keys=True), seed, size)


@functools.lru_cache(maxsize=4)
def _split_questions(name: str, config_json: str, seed: int, size: int) -> frozenset[str]:
    entries = generate_entries(name, json.loads(config_json), seed, size)
    return frozenset(entry["question"] for entry in entries)


class ReasoningGymSource(IndexedSource):
    """`size` prompts of the reasoning_gym dataset `name`, one split of it.

    Args:
        name: a reasoning_gym dataset name, e.g. "chain_sum".
        config: the dataset's config fields (e.g. {"min_terms": 2, "max_terms": 3}).
        seed: the base seed; each split adds its offset from `SPLIT_SEED_OFFSETS`.
        size: number of prompts.
        split: "train" (RL prompts), "sft" (warm-start data) or "eval" (held out).
        exclude_sizes: for the eval split, how many items of each training split to
            deduplicate against, e.g. {"train": 10_000, "sft": 64_000}; the eval split then
            holds only questions that appear in none of them, and each question once.

    Item `i` has uid "<name>:<split>:<i>"; the answer is the dataset's answer and the metadata
    the dataset entry's metadata, which names its `source_dataset`.
    """

    def __init__(
        self,
        name: str,
        config: dict[str, Any] | None = None,
        seed: int = 0,
        size: int = 1000,
        split: str = "train",
        exclude_sizes: dict[str, int] | None = None,
    ):
        if split not in SPLIT_SEED_OFFSETS:
            raise ValueError(f"split {split!r} is not one of {sorted(SPLIT_SEED_OFFSETS)}")
        if size > SPLIT_SEED_OFFSETS["sft"]:
            raise ValueError(
                f"size {size} would overlap the next split's seeds; at most "
                f"{SPLIT_SEED_OFFSETS['sft']}"
            )
        self.name, self.config, self.seed, self.split = name, dict(config or {}), seed, split
        split_seed = seed + SPLIT_SEED_OFFSETS[split]
        if split == "eval":
            entries = self._held_out_entries(split_seed, size, exclude_sizes or {})
        else:
            if exclude_sizes:
                raise ValueError("exclude_sizes applies to the eval split only")
            entries = generate_entries(name, self.config, split_seed, size)
        self._items = [self._item(i, entry) for i, entry in enumerate(entries)]

    def _held_out_entries(self, split_seed: int, size: int, exclude_sizes: dict[str, int]):
        unknown = set(exclude_sizes) - set(TRAINING_SPLITS)
        if unknown:
            raise ValueError(f"exclude_sizes names {sorted(unknown)}; use {TRAINING_SPLITS}")
        seen = set().union(
            *(
                split_questions(self.name, self.config, self.seed + SPLIT_SEED_OFFSETS[split], n)
                for split, n in exclude_sizes.items()
            )
        )
        kept: list[dict] = []
        drawn = 0
        # Draw in doubling chunks until enough unseen questions; the chunking does not change
        # which entries are kept, because entry idx depends only on split_seed + idx. A chunk
        # as large as everything drawn before that adds nothing new means the config's
        # question space is used up.
        while len(kept) < size:
            chunk = max(size, drawn, 1000)
            if drawn + chunk > SPLIT_SEED_OFFSETS["sft"]:
                raise ValueError(f"eval split of {self.name} would overlap the next seed region")
            dataset = reasoning_gym.create_dataset(
                self.name, seed=split_seed, size=drawn + chunk, **self.config
            )
            before = len(kept)
            for i in range(drawn, drawn + chunk):
                entry = dataset[i]
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    kept.append(entry)
                    if len(kept) == size:
                        break
            drawn += chunk
            if len(kept) == before:
                raise ValueError(
                    f"{self.name} with config {self.config} has fewer than {size} questions "
                    f"outside the training splits; found {len(kept)} in {drawn} draws"
                )
        return kept

    def _item(self, index: int, entry: dict) -> PromptItem:
        metadata = copy.deepcopy(entry["metadata"])
        metadata.setdefault("source_dataset", self.name)
        return PromptItem(
            uid=f"{self.name}:{self.split}:{index}",
            question=entry["question"],
            answer=str(entry["answer"]),
            metadata=metadata,
        )
