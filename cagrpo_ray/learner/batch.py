"""The learner batch contract (docs/architecture.md): its keys, shapes and prompt groups.

A dict of tensors, one row per response, every per-token tensor aligned with `input_ids`:
prompt tokens then response tokens, right-padded; `behavior_logprobs` at the token they
belong to; `advantages` computed when the groups were scored; groups contiguous, whole and of
one size.
"""

from __future__ import annotations

import torch

BATCH_KEYS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "behavior_logprobs",
    "rewards",
    "advantages",
    "group_ids",
)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left or right padding gives the same ids."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def group_sizes(group_ids: torch.Tensor) -> torch.Tensor:
    """Sizes of the contiguous runs of equal ids; raises if a group id reappears later."""
    ids, counts = torch.unique_consecutive(group_ids, return_counts=True)
    if ids.unique().numel() != ids.numel():
        raise ValueError("group_ids must be contiguous: each prompt group's rows in one run")
    return counts


def check_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Raise a ValueError naming the first key that breaks the learner batch contract."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"learner batch is missing {missing}; it needs {list(BATCH_KEYS)}")
    rows, width = batch["input_ids"].shape
    for key in ("attention_mask", "response_mask", "behavior_logprobs"):
        if tuple(batch[key].shape) != (rows, width):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected {(rows, width)} "
                "like input_ids"
            )
    for key in ("rewards", "advantages", "group_ids"):
        if tuple(batch[key].shape) != (rows,):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(batch[key].shape)}, expected {(rows,)}"
            )
    if rows == 0:
        raise ValueError("learner batch has no rows")
    sizes = group_sizes(batch["group_ids"]).unique()
    if sizes.numel() != 1:
        raise ValueError(f"prompt groups must all have one size, got sizes {sizes.tolist()}")
    return batch
