"""An algorithm of one's own, in one's own file: a plugin (`algorithm.plugins`).

Named in the config, this file is imported before the config is checked, in the driver and in
every learner rank, so the names it registers are config values like the built-in ones:

    algorithm:
      plugins: [examples/my_algorithm/my_algo.py]
      advantage_estimator: median_baseline
      policy_loss: reinforce
      group_filters: [some_correct]

    python -m cagrpo_ray.run --config configs/cpu-tiny.yaml \
        --config examples/my_algorithm/config.yaml

Nothing of the package is edited. A name the package (or another plugin) already has is
refused, naming both definitions; so is a function with the wrong signature.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from cagrpo_ray.algo import (
    register_advantage_estimator,
    register_group_filter,
    register_policy_loss,
)


@register_advantage_estimator("median_baseline", min_group_size=2)
def median_baseline(rewards: Tensor) -> Tensor:
    """A_i = r_i - median(r) over the group [groups, G] (float64): a baseline that one
    outlying reward does not move."""
    return rewards - rewards.median(dim=1, keepdim=True).values


@register_policy_loss("reinforce")
def reinforce(x) -> tuple[Tensor, dict[str, float]]:
    """Plain REINFORCE with the importance ratio: loss_t = -A * r_t (no clip), whose gradient
    at r = 1 is -A * grad log pi(o_t). One metric of its own: the mean advantage of its tokens."""
    mean_advantage = float((x.advantages * x.mask).sum() / max(x.num_valid, 1.0))
    return -x.advantages * x.ratio, {"policy/reinforce_mean_advantage": mean_advantage}


@register_group_filter("some_correct")
def some_correct(rewards: np.ndarray) -> np.ndarray:
    """Keep a group [G rewards] only if some response scored above 0."""
    return (rewards > 0).any(axis=1)
