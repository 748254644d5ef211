"""KL to a frozen reference policy, as a loss term: the estimators of `LossSpec.kl_estimator`.

Per valid token, with d = log pi(o_t) - log pi_ref(o_t) on the sampled token o_t ~ pi_old
(Schulman 2020, "Approximating KL divergence"; verl's `kl_penalty` under its other names):

    k1   (verl "kl"):          d                          unbiased, can be negative
    abs  (verl "abs"):         |d|
    k2   (verl "mse"):         d^2 / 2                    biased, low variance
    k3   (verl "low_var_kl"):  e^x - x - 1,  x = clamp(-d, -20, 20),  then clamped to [-10, 10]

k3 is unbiased and never negative; the final clamp is verl's: a token whose k3 exceeds 10
gives the penalty no gradient, so one token the policy has moved far from the reference cannot
dominate the update. The loss adds kl_coef * agg(estimate) with the loss's own aggregation
(verl's `use_kl_loss`); the gradient flows through log pi.

KL in the reward (verl's `use_kl_in_reward`: a per-token penalty subtracted from the reward
before the advantages) is not offered: advantages are computed once, on the driver, when a
group is scored, before the learner has the reference log-probs.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")

K3_LOG_RATIO_LIMIT = 20.0  # x is clamped here before exp, so e^x never overflows
K3_LIMIT = 10.0  # verl clamps each token's k3 to [-10, 10]


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref), [B, T], differentiable w.r.t. `logprobs`.

    Args:
        logprobs: [B, T] log pi of the sampled tokens, with gradient.
        ref_logprobs: [B, T] log pi_ref of the same tokens (no gradient needed).
        estimator: one of KL_ESTIMATORS (see the module docstring).
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        x = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_LIMIT, K3_LOG_RATIO_LIMIT)
        return (torch.exp(x) - x - 1.0).clamp(-K3_LIMIT, K3_LIMIT)
    raise ValueError(f"kl_estimator {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
