"""The paper in code, in pure torch: advantages, policy losses, entropy and covariance statistics,
and the learning-rate schedule.

Nothing here imports the rest of cagrpo_ray; every function is testable in milliseconds.
"""

from cagrpo_ray.algo.advantages import group_advantages
from cagrpo_ray.algo.covariance import (
    cagrpo_token_weights,
    clip_cov_selection,
    kl_cov_selection,
    token_covariance,
)
from cagrpo_ray.algo.entropy import entropy_from_logits, logprobs_from_logits
from cagrpo_ray.algo.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossSpec,
    PolicyLossOutput,
    PreparedLoss,
    policy_loss,
    prepare_loss_inputs,
    register_policy_loss,
)
from cagrpo_ray.algo.off_policy import truncated_is_weights
from cagrpo_ray.algo.schedules import LR_SCHEDULES, lr_factor
from cagrpo_ray.algo.stats import (
    COVARIANCE_TABLE_FRACTIONS,
    covariance_quantiles,
    format_covariance_table,
)

__all__ = [
    "COVARIANCE_TABLE_FRACTIONS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LR_SCHEDULES",
    "POLICY_LOSSES",
    "LossSpec",
    "PolicyLossOutput",
    "PreparedLoss",
    "cagrpo_token_weights",
    "clip_cov_selection",
    "covariance_quantiles",
    "entropy_from_logits",
    "format_covariance_table",
    "group_advantages",
    "kl_cov_selection",
    "logprobs_from_logits",
    "lr_factor",
    "policy_loss",
    "prepare_loss_inputs",
    "register_policy_loss",
    "token_covariance",
    "truncated_is_weights",
]
