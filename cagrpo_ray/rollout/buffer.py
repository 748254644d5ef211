"""The rollout buffer: scored groups as Arrow record batches, handed to the learner whole.

One row per response. The schema (`ROLLOUT_SCHEMA`):

| column | type | meaning |
|---|---|---|
| prompt_uid | string | stable id of the prompt (`PromptItem.uid`) |
| group_id | int64 | one per prompt group; every group is stored and taken whole |
| prompt_token_ids | list<int32> | the formatted prompt |
| response_token_ids | list<int32> | the sampled response |
| behavior_logprobs | list<float32> | generator's log-prob of each response token |
| reward | float32 | weighted verifier reward |
| correct | bool | task verifier's verdict |
| advantage | float32 | GRPO group advantage of the response (what the learner trains on) |
| policy_version | int64 | version of the weights that sampled it |
| prompt_len, response_len | int32 | token counts |
| finish_reason | string | "stop", "length" or (multi-turn) "turns" |
| policy_mask | list<bool> | per response token: the policy's (True) or a tool result's |
| turns, tool_calls, tool_errors, tool_timeouts | int16 | a multi-turn episode's counts |
| tool_seconds | float32 | wall time of the episode's tool calls |

`policy_mask` is null when every token is the policy's (single-turn rows, and episodes that
called no tool); a single-turn row has 1 turn and no tool call.

Groups leave whole, by group id (`take_ids`: the schedule takes each batch in start order);
the rest keep their arrival order. `drop_stale(v)` drops whole groups sampled by a policy
older than `v` and counts them (`dropped_stale`). Conversion to the learner's padded tensors
(`to_learner_batch`) works on the Arrow offsets with numpy, without a Python loop over rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from cagrpo_ray.types import Completion

ROLLOUT_SCHEMA = pa.schema(
    [
        ("prompt_uid", pa.string()),
        ("group_id", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float32()),
        ("correct", pa.bool_()),
        ("advantage", pa.float32()),
        ("policy_version", pa.int64()),
        ("prompt_len", pa.int32()),
        ("response_len", pa.int32()),
        ("finish_reason", pa.string()),
        ("policy_mask", pa.list_(pa.bool_())),
        ("turns", pa.int16()),
        ("tool_calls", pa.int16()),
        ("tool_errors", pa.int16()),
        ("tool_timeouts", pa.int16()),
        ("tool_seconds", pa.float32()),
    ]
)


def group_record_batch(
    prompt_uid: str,
    group_id: int,
    completions: Sequence[Completion],
    rewards: Sequence[float],
    correct: Sequence[bool],
    advantages: Sequence[float],
) -> pa.RecordBatch:
    """One prompt's group of `Completion`s (see cagrpo_ray/types.py) as a record batch."""
    n = len(completions)
    if not (n == len(rewards) == len(correct) == len(advantages)):
        raise ValueError(
            f"group {group_id}: {n} completions but {len(rewards)} rewards, "
            f"{len(correct)} verdicts, {len(advantages)} advantages"
        )
    for c in completions:
        if len(c.token_ids) != len(c.logprobs):
            raise ValueError(
                f"group {group_id} ({prompt_uid}): {len(c.token_ids)} tokens but "
                f"{len(c.logprobs)} behavior log-probs"
            )
        if c.from_policy is not None and len(c.from_policy) != len(c.token_ids):
            raise ValueError(
                f"group {group_id} ({prompt_uid}): {len(c.token_ids)} tokens but "
                f"{len(c.from_policy)} policy-mask entries"
            )
    columns = {
        "prompt_uid": [prompt_uid] * n,
        "group_id": [group_id] * n,
        "prompt_token_ids": [list(c.prompt_token_ids) for c in completions],
        "response_token_ids": [list(c.token_ids) for c in completions],
        "behavior_logprobs": [list(c.logprobs) for c in completions],
        "reward": list(rewards),
        "correct": list(correct),
        "advantage": list(advantages),
        "policy_version": [c.policy_version for c in completions],
        "prompt_len": [len(c.prompt_token_ids) for c in completions],
        "response_len": [len(c.token_ids) for c in completions],
        "finish_reason": [c.finish_reason for c in completions],
        "policy_mask": [c.from_policy for c in completions],
        "turns": [c.turns for c in completions],
        "tool_calls": [c.tool_calls for c in completions],
        "tool_errors": [c.tool_errors for c in completions],
        "tool_timeouts": [c.tool_timeouts for c in completions],
        "tool_seconds": [c.tool_seconds for c in completions],
    }
    return pa.RecordBatch.from_pydict(columns, schema=ROLLOUT_SCHEMA)


class RolloutBuffer:
    """FIFO of whole groups, each an Arrow record batch, with staleness accounting."""

    def __init__(self):
        self._groups: deque[pa.RecordBatch] = deque()
        self.dropped_stale = 0  # groups dropped for staleness

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, group: pa.RecordBatch) -> None:
        if group.schema != ROLLOUT_SCHEMA:
            raise ValueError(f"rollout group has schema {group.schema}, expected {ROLLOUT_SCHEMA}")
        if len(set(group.column("group_id").to_pylist())) != 1:
            raise ValueError("a rollout group must hold exactly one group_id")
        self._groups.append(group)

    def drop_stale(self, min_version: int) -> int:
        """Drop groups holding any sample from a policy older than `min_version`."""
        kept: deque[pa.RecordBatch] = deque()
        dropped = 0
        for group in self._groups:
            oldest = min(group.column("policy_version").to_pylist())
            if oldest < min_version:
                dropped += 1
            else:
                kept.append(group)
        self._groups = kept
        self.dropped_stale += dropped
        return dropped

    def group_ids(self) -> list[int]:
        """The buffered groups' ids, in arrival order."""
        return [group.column("group_id")[0].as_py() for group in self._groups]

    def take_ids(self, group_ids: Sequence[int]) -> pa.Table:
        """Remove and return the buffered groups `group_ids`, in that order."""
        by_id = {group.column("group_id")[0].as_py(): group for group in self._groups}
        missing = [g for g in group_ids if g not in by_id]
        if missing:
            raise KeyError(f"groups {missing} are not buffered")
        taken = [by_id.pop(g) for g in group_ids]
        self._groups = deque(by_id.values())  # the rest, still in arrival order
        return pa.Table.from_batches(taken, schema=ROLLOUT_SCHEMA)

    def to_table(self) -> pa.Table:
        """Everything still buffered (for checkpoints and inspection), without removing it."""
        return pa.Table.from_batches(list(self._groups), schema=ROLLOUT_SCHEMA)

    def load_table(self, table: pa.Table) -> None:
        """Refill from a table written by `to_table` (groups keep their order)."""
        if not table.schema.equals(ROLLOUT_SCHEMA):
            raise ValueError(f"rollout table has schema {table.schema}, expected {ROLLOUT_SCHEMA}")
        self._groups.clear()
        if table.num_rows == 0:
            return
        group_ids = table.column("group_id").to_numpy()
        starts = np.flatnonzero(np.r_[True, group_ids[1:] != group_ids[:-1]])
        ends = np.r_[starts[1:], len(group_ids)]
        for start, end in zip(starts, ends, strict=True):
            self._groups.append(table.slice(start, end - start).combine_chunks().to_batches()[0])

    def dump_parquet(self, path: str | Path, table: pa.Table | None = None) -> Path:
        """Write rollouts (the given table, or the buffer's contents) to Parquet."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(self.to_table() if table is None else table, path)
        return path


def _scatter(column: pa.ChunkedArray | pa.Array, shift: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Write each row's list values into `out[row, shift[row] + j]`; returns the row lengths."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    values = values[offsets[0] : offsets[-1]]
    lengths = np.diff(offsets)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(len(values)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    out[rows, shift[rows] + within] = values
    return lengths


def to_learner_batch(table: pa.Table, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Padded tensors in the learner's batch contract (docs/architecture.md).

    Rows are prompt then response, right-padded to the longest row; `behavior_logprobs` sits
    at the response tokens it belongs to ("at the token"), 0 elsewhere. `response_mask` marks
    the tokens trained on: the policy's own, never an environment's (`policy_mask`).
    """
    prompt_len = table.column("prompt_len").to_numpy().astype(np.int64)
    response_len = table.column("response_len").to_numpy().astype(np.int64)
    batch, width = table.num_rows, int((prompt_len + response_len).max())
    input_ids = np.full((batch, width), pad_token_id, dtype=np.int64)
    behavior = np.zeros((batch, width), dtype=np.float32)
    _scatter(table.column("prompt_token_ids"), np.zeros(batch, dtype=np.int64), input_ids)
    _scatter(table.column("response_token_ids"), prompt_len, input_ids)
    _scatter(table.column("behavior_logprobs"), prompt_len, behavior)
    positions = np.arange(width)[None, :]
    attention = positions < (prompt_len + response_len)[:, None]
    response = attention & (positions >= prompt_len[:, None])
    policy_mask = table.column("policy_mask")
    if policy_mask.null_count < table.num_rows:  # multi-turn: tool results are context only
        policy = np.ones((batch, width), dtype=bool)
        _scatter(policy_mask, prompt_len, policy)  # a null row has no values: all the policy's
        response &= policy
    return {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention.astype(np.int64)),
        "response_mask": torch.from_numpy(response),
        "behavior_logprobs": torch.from_numpy(behavior),
        "rewards": torch.from_numpy(table.column("reward").to_numpy().astype(np.float32)),
        "advantages": torch.from_numpy(table.column("advantage").to_numpy().astype(np.float32)),
        "group_ids": torch.from_numpy(table.column("group_id").to_numpy().astype(np.int64)),
        "policy_version": torch.from_numpy(
            table.column("policy_version").to_numpy().astype(np.int64)
        ),
    }
