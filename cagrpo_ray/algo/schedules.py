"""The learning-rate schedule: a factor of the base learning rate for each scheduler step.

A linear warm-up, then constant, linear or cosine (verl's `lr_scheduler_type`). With s the
0-indexed step (the s-th call of the scheduler), W the warm-up steps, T the total steps and
m = min_lr_ratio:

    warm-up, s < W:    (s + 1) / W                  lr / W on the first step, lr on step W - 1
    constant:          1
    linear:            1 - (1 - m) p                p = min(1, (s - W) / max(1, T - W))
    cosine:            m + (1 - m) (1 + cos(pi p)) / 2

The warm-up is one step ahead of verl's s / W, so the first step is not taken at lr 0; from
step W on, linear and cosine are verl's (its cosine at num_cycles 0.5), decaying from 1 at
s = W towards m at s = T. p stops at 1: a run that goes past T stays at m instead of the
cosine rising again. W = 0 is no warm-up.
"""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(
    step: int,
    total_steps: int | None,
    warmup_steps: int,
    kind: str = "constant",
    min_lr_ratio: float = 0.0,
) -> float:
    """The factor of the base learning rate at scheduler step `step` (0-indexed; see above).

    `total_steps` is the number of scheduler steps of the run; "constant" does not use it (it
    may be None), "linear" and "cosine" need it. `min_lr_ratio` in [0, 1] is where they end.
    """
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {kind!r} is not one of {', '.join(LR_SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps or kind == "constant":
        # the learner's warm-up formula from before schedules existed: kept bit for bit
        return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    if total_steps is None or total_steps < 1:
        raise ValueError(f"a {kind} schedule needs total_steps >= 1, got {total_steps}")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
