"""Advantage estimators behind one registry: a response's advantage from its group's rewards.

For each prompt, G responses are sampled; an estimator maps the rewards of each group, one row
of a [num_groups, G] float64 tensor, to one advantage per response:

    grpo     A_i = (r_i - mean(r)) / (std(r) + eps)   std unbiased (ddof=1), as torch.std
             (GRPO, Shao et al. 2024)
    dr_grpo  A_i =  r_i - mean(r)                      (Dr.GRPO, Liu et al. 2025)
    rloo     A_i =  r_i - sum_{j != i} r_j / (G - 1)   (RLOO, Ahmadian et al. 2024), G > 1
    reinforce_pp                                       (REINFORCE++-baseline, Hu et al. 2025)
             a_i =  r_i - mean(r)                      group stage (G = 1: a_i = r_i)
             A_i = (a_i - mu) / sqrt(max(var, 1e-8))   batch stage, mu and var over every
                                                       token trained in the learner batch

The advantage is one number per response; the losses broadcast it to the response's tokens.
The advantages are computed when a chunk's groups are assessed (`recipe.py`), so an estimator
sees only whole groups. One that also needs the whole learner batch (a normalisation over
it) registers a second, batch stage, which the runtime applies to the batch it is about to
train on.

Adding an estimator is one function and one name (docs/extending.md):

    @register_advantage_estimator("mean_baseline")
    def mean_baseline(rewards: Tensor) -> Tensor:     # [num_groups, G] float64 -> same shape
        return rewards - rewards.mean(dim=1, keepdim=True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cagrpo_ray.algo.registries import Registry

GroupStage = Callable[[Tensor], Tensor]  # [num_groups, G] float64 -> [num_groups, G]
BatchStage = Callable[[Tensor, Tensor], Tensor]  # advantages [B], mask [B, T] -> [B]


@dataclass(frozen=True)
class RegisteredEstimator:
    group: GroupStage
    batch: BatchStage | None  # None: the group stage's advantages are trained as they are
    min_group_size: int  # the smallest G the estimator is defined for


ADVANTAGE_ESTIMATORS: Registry[RegisteredEstimator] = Registry("advantage estimator", takes=1)


def register_advantage_estimator(
    name: str, batch: BatchStage | None = None, min_group_size: int = 1
):
    """Register `fn(rewards: [num_groups, G] float64) -> [num_groups, G]` under `name`.

    `batch(advantages: [B] float32, mask: [B, T] bool) -> [B]` is an optional second stage
    over the learner batch (whole groups, after the token masks); `min_group_size` the
    smallest group the estimator accepts.
    """

    def decorator(fn: GroupStage) -> GroupStage:
        ADVANTAGE_ESTIMATORS.add(name, RegisteredEstimator(fn, batch, min_group_size), fn)
        return fn

    return decorator


def lookup_estimator(name: str) -> RegisteredEstimator:
    """The registered estimator `name`; an unknown name is an error that lists the known ones."""
    return ADVANTAGE_ESTIMATORS.lookup(name)


GRPO_EPS = 1e-6  # added to the std so that a group whose rewards are all equal gets A = 0


@register_advantage_estimator("grpo")
def grpo(rewards: Tensor) -> Tensor:
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + 1e-6) over the group (unbiased std); a group
    of one response has A = 0 (its std is taken as 0, not NaN)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if rewards.shape[1] > 1:
        centred = centred / (rewards.std(dim=1, keepdim=True) + GRPO_EPS)
    return centred


@register_advantage_estimator("dr_grpo")
def dr_grpo(rewards: Tensor) -> Tensor:
    """Dr.GRPO: A_i = r_i - mean(r), no std division (which biases towards groups whose
    rewards barely differ, Liu et al. 2025)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


@register_advantage_estimator("rloo", min_group_size=2)
def rloo(rewards: Tensor) -> Tensor:
    """RLOO: each response's baseline is the mean reward of the other G - 1 responses to its
    prompt, so A_i does not depend on r_i through the baseline (an unbiased estimate)."""
    others = rewards.sum(dim=1, keepdim=True) - rewards
    return rewards - others / (rewards.shape[1] - 1)


VARIANCE_FLOOR = 1e-8


def batch_normalise(advantages: Tensor, mask: Tensor) -> Tensor:
    """REINFORCE++'s batch stage: A_i = (a_i - mu) / sqrt(max(var, 1e-8)), with mu and var the
    token-weighted mean and population variance of a over the batch's trained tokens

        mu = sum_i n_i a_i / N,   var = sum_i n_i (a_i - mu)^2 / N,   N = sum_i n_i

    (n_i the trained tokens of response i, after the token masks): every token of response i
    carries a_i, and the statistics are those of the tokens, as OpenRLHF and verl take them.
    advantages: [B]; mask: [B, T] bool. Returns [B] in the dtype of `advantages`. A batch
    without a trained token is returned as it is (nothing trains on it)."""
    tokens = mask.sum(dim=1).to(torch.float64)  # n_i
    total = tokens.sum()
    if total == 0:
        return advantages
    a = advantages.detach().to(torch.float64)
    mean = (tokens * a).sum() / total
    var = (tokens * (a - mean) ** 2).sum() / total
    return ((a - mean) * var.clamp(min=VARIANCE_FLOOR).rsqrt()).to(advantages.dtype)


@register_advantage_estimator("reinforce_pp", batch=batch_normalise)
def reinforce_pp(rewards: Tensor) -> Tensor:
    """REINFORCE++-baseline's group stage: the group's mean reward as the baseline (none for a
    group of one: plain REINFORCE++), no std division; the batch stage then normalises over
    the learner batch, not over each group, which is what sets it apart from GRPO."""
    if rewards.shape[1] == 1:
        return rewards.clone()
    return rewards - rewards.mean(dim=1, keepdim=True)


def group_advantages(rewards: Tensor, group_size: int, estimator: str = "grpo") -> Tensor:
    """Advantage of each response relative to the other responses to the same prompt.

    Args:
        rewards: [B] scalar rewards, flat, groups contiguous and whole (B = num_groups * G).
        group_size: G, responses per prompt.
        estimator: a registered advantage estimator (its group stage).

    Returns:
        [B] float32 advantages (float64 if `rewards` is float64), no gradient.
    """
    registered = lookup_estimator(estimator)
    if group_size < registered.min_group_size:
        raise ValueError(
            f"advantage estimator {estimator!r} needs groups of at least "
            f"{registered.min_group_size} responses, got group_size={group_size}"
        )
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be flat with a length divisible by group_size={group_size}; "
            f"got shape {tuple(rewards.shape)}"
        )
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    # float64 inside: the mean of equal float32 rewards is then exact, so such a group gets
    # exactly A = 0 instead of rounding noise divided by (0 + eps).
    r = rewards.detach().to(torch.float64).view(-1, group_size)  # [num_groups, G]
    return registered.group(r).reshape(-1).to(dtype)


def batch_advantages(advantages: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """The learner batch's advantages [B] after the estimator's batch stage (unchanged, the
    same tensor, for an estimator without one); `mask` [B, T] marks the tokens trained."""
    stage = lookup_estimator(estimator).batch
    return advantages if stage is None else stage(advantages, mask)
