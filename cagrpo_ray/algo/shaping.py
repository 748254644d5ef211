"""Reward shaping behind one registry: what a response's reward becomes before its advantage.

    overlong_penalty   r += min(-(|y| - (L_max - L_buf)) / L_buf * factor, 0)
                       (DAPO's soft overlong penalty, Yu et al. 2025): |y| the response's
                       tokens, L_max = rollout.max_tokens, L_buf = overlong_buffer_len,
                       factor = overlong_penalty_factor; 0 outside the last L_buf tokens.

A shaping sees a chunk's responses flat (groups contiguous) and the recipe's options
(`RecipeSpec`); the verifiers' verdicts (`correct`) are never shaped. Adding one is one
function and one name: `@register_reward_shaping("name")`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cagrpo_ray.algo.registries import Registry

# rewards [n] float32, response lengths [n] (tokens), the recipe's options -> [n] float32
RewardShapingFn = Callable[[np.ndarray, np.ndarray, object], np.ndarray]

REWARD_SHAPINGS: Registry[RewardShapingFn] = Registry("reward shaping", takes=3)


def register_reward_shaping(name: str):
    """Register `fn(rewards [n] float32, lengths [n], spec: RecipeSpec) -> [n] float32`."""

    def decorator(fn: RewardShapingFn) -> RewardShapingFn:
        REWARD_SHAPINGS.add(name, fn, fn)
        return fn

    return decorator


def overlong_penalty(lengths: np.ndarray, max_tokens: int, buffer_len: int, factor: float):
    """DAPO's soft overlong penalty per response [n] float32 (0 outside the last `buffer_len`
    tokens, -factor at `max_tokens`)."""
    start = max_tokens - buffer_len
    return np.minimum(-(lengths - start) / buffer_len * factor, 0.0).astype(np.float32)


@register_reward_shaping("overlong_penalty")
def shape_overlong(rewards: np.ndarray, lengths: np.ndarray, spec) -> np.ndarray:
    penalty = overlong_penalty(
        np.asarray(lengths, dtype=np.float32),
        spec.max_tokens,
        spec.overlong_buffer_len,
        spec.overlong_penalty_factor,
    )
    return (rewards + penalty).astype(np.float32)
