"""Which groups and which tokens enter a learner batch, behind two registries.

Group filters, applied when a chunk's groups are assessed, each keeping a subset of them:

    dynamic_sampling   keep a group only if its (shaped) rewards differ: a group whose
                       rewards are all equal has A = 0 everywhere, no signal (DAPO, Yu et al.
                       2025). More groups are generated in place of those dropped, at most
                       `max_gen_batches` batches' worth for one batch.

Token masks, applied to the learner batch before it is trained on, each removing tokens from
the loss (and from every statistic over tokens):

    overlong           a truncated response (finish reason "length") carries no loss.

Adding one is one function and one name: `@register_group_filter("name")`,
`@register_token_mask("name")`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import Tensor

from cagrpo_ray.algo.registries import Registry

GroupFilterFn = Callable[[np.ndarray], np.ndarray]  # rewards [num_groups, G] -> keep [num_groups]
TokenMaskFn = Callable[[Tensor, Tensor], Tensor]  # mask [B, T], truncated [B] -> mask [B, T]

GROUP_FILTERS: Registry[GroupFilterFn] = Registry("group filter", takes=1)
TOKEN_MASKS: Registry[TokenMaskFn] = Registry("token mask", takes=2)


def register_group_filter(name: str):
    """Register `fn(rewards: [num_groups, G] float32) -> keep: [num_groups] bool`."""

    def decorator(fn: GroupFilterFn) -> GroupFilterFn:
        GROUP_FILTERS.add(name, fn, fn)
        return fn

    return decorator


def register_token_mask(name: str):
    """Register `fn(mask: [B, T] bool, truncated: [B] bool) -> [B, T] bool`."""

    def decorator(fn: TokenMaskFn) -> TokenMaskFn:
        TOKEN_MASKS.add(name, fn, fn)
        return fn

    return decorator


@register_group_filter("dynamic_sampling")
def groups_with_signal(rewards: np.ndarray) -> np.ndarray:
    return np.ptp(rewards, axis=1) > 0


@register_token_mask("overlong")
def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    return mask & ~truncated[:, None]
