"""Group-relative advantages (GRPO, Shao et al. 2024; Dr.GRPO, Liu et al. 2025).

For each prompt, G responses are sampled; response i of a group gets

    GRPO:     A_i = (r_i - mean(r)) / (std(r) + eps)     std unbiased (ddof=1), as torch.std
    Dr.GRPO:  A_i =  r_i - mean(r)                        (std_normalize=False)

The advantage is one number per response; the losses broadcast it to the response's tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """Advantage of each response relative to the other responses to the same prompt.

    Args:
        rewards: [B] scalar rewards, flat, groups contiguous and whole (B = num_groups * G).
        group_size: G, responses per prompt.
        std_normalize: divide by the group's sample std (GRPO); False gives Dr.GRPO.
        eps: added to the std so that a group whose rewards are all equal gets A = 0.

    Returns:
        [B] float32 advantages (float64 if `rewards` is float64), no gradient.
        A group of one response has A = 0 (its std is taken as 0, not NaN).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be flat with a length divisible by group_size={group_size}; "
            f"got shape {tuple(rewards.shape)}"
        )
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    # float64 inside: the mean of equal float32 rewards is then exact, so such a group gets
    # exactly A = 0 instead of rounding noise divided by (0 + eps).
    r = rewards.detach().to(torch.float64).view(-1, group_size)  # [num_groups, G]
    centred = r - r.mean(dim=1, keepdim=True)
    if std_normalize and group_size > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1).to(dtype)
