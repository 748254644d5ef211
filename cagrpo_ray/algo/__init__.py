"""The paper in code, in pure torch: what is trained, behind registries with one signature each.

Advantage estimators (`advantages.py`), reward shaping (`shaping.py`), group filters and token
masks (`selection.py`), loss-option controllers (`controllers.py`), composed by the runtime's
one entry point, the `Recipe` (`recipe.py`); the policy losses with their per-token weights and
inspector fields (`registry.py`, `losses.py`); entropy and covariance statistics, and the
learning-rate schedule. docs/extending.md adds an entry.

Nothing here imports the rest of cagrpo_ray; every function is testable in milliseconds.
"""

from cagrpo_ray.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    group_advantages,
    register_advantage_estimator,
)
from cagrpo_ray.algo.controllers import CONTROLLERS, register_controller
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
    shown_field,
    token_fields,
)
from cagrpo_ray.algo.off_policy import truncated_is_weights
from cagrpo_ray.algo.recipe import GroupOutcome, Recipe, RecipeSpec
from cagrpo_ray.algo.schedules import LR_SCHEDULES, lr_factor
from cagrpo_ray.algo.selection import (
    GROUP_FILTERS,
    TOKEN_MASKS,
    register_group_filter,
    register_token_mask,
)
from cagrpo_ray.algo.shaping import REWARD_SHAPINGS, register_reward_shaping
from cagrpo_ray.algo.stats import (
    COVARIANCE_TABLE_FRACTIONS,
    covariance_quantiles,
    format_covariance_table,
)

# every registry of the algorithm, one `Registry` each (`registries.py`)
REGISTRIES = (
    ADVANTAGE_ESTIMATORS, POLICY_LOSSES, REWARD_SHAPINGS, GROUP_FILTERS, TOKEN_MASKS, CONTROLLERS,
)  # fmt: skip

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CONTROLLERS",
    "COVARIANCE_TABLE_FRACTIONS",
    "GROUP_FILTERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LR_SCHEDULES",
    "POLICY_LOSSES",
    "REGISTRIES",
    "REWARD_SHAPINGS",
    "TOKEN_MASKS",
    "GroupOutcome",
    "LossSpec",
    "PolicyLossOutput",
    "PreparedLoss",
    "Recipe",
    "RecipeSpec",
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
    "register_advantage_estimator",
    "register_controller",
    "register_group_filter",
    "register_policy_loss",
    "register_reward_shaping",
    "register_token_mask",
    "shown_field",
    "token_covariance",
    "token_fields",
    "truncated_is_weights",
]
