"""Off-policy correction: truncated importance weights from the behavior to the proximal policy.

Samples come from the behavior policy mu (the generator's weights, possibly some versions old,
and another kernel even when not); the learner recomputes the proximal policy pi_prox (its own
weights before this step) and optimizes pi_theta (decoupled PPO, Hilton et al. 2022; AReaL;
verl's truncated IS):

    L(theta) = - sum_t  w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    r_t = pi_theta(o_t) / pi_prox(o_t)                 the PPO ratio: the trust region
    w_t = min(pi_prox(o_t) / mu(o_t), cap)             no gradient: corrects mu -> pi_prox

with A_t the (CA-GRPO-reweighted) advantage. The trust region is taken around pi_prox, not mu,
so stale data does not widen it; truncating w_t at `cap` bounds the variance that a token much
likelier under pi_prox than under mu would bring. CA-GRPO's covariance and the Clip-Cov/KL-Cov
selections use log pi_prox (the learner's own log-probs), never mu's.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CAP = 20.0  # exp(20) ~ 5e8: beyond any cap, and far from overflow


def truncated_is_weights(
    proximal_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """w_t = min(pi_prox(o_t) / mu(o_t), cap) per token, 0 off the mask; no gradient.

    Args:
        proximal_logprobs, behavior_logprobs: [B, T] log-probs of the sampled tokens under
            pi_prox (learner) and mu (generator).
        mask: [B, T] bool, the valid response tokens.
        cap: the truncation, > 0.

    Returns:
        (weights [B, T] float32, metrics): `tis/weight_mean` and `tis/truncated_frac`, the
        means over this call's valid tokens (0 when there are none).
    """
    if cap <= 0:
        raise ValueError(f"the truncated IS cap must be positive, got {cap}")
    with torch.no_grad():
        raw = torch.exp((proximal_logprobs - behavior_logprobs).clamp(max=LOG_RATIO_CAP)) * mask
        weights = raw.clamp(max=cap)
        valid = mask.bool()
        any_token = bool(valid.any())
        metrics = {
            "tis/weight_mean": float(weights[valid].mean()) if any_token else 0.0,
            "tis/truncated_frac": float((raw > cap)[valid].float().mean()) if any_token else 0.0,
        }
    return weights, metrics


def weight_gradient(logprobs: Tensor, weights: Tensor) -> Tensor:
    """`logprobs` with the same values and each token's gradient scaled by `weights`.

    Every term of the loss that depends on log pi_theta then has w_t times its gradient,
    which is the gradient of w_t * L_t for the constant w_t; the logged loss keeps its
    unweighted value.
    """
    detached = logprobs.detach()
    return detached + weights * (logprobs - detached)
