"""The recipe: everything that decides what is trained, besides the policy loss, in one object
the runtime calls without knowing which entries are configured.

    verifier rewards r, lengths |y|       (one chunk's groups, flat, groups contiguous)
      -> reward shaping                   shaping.py     e.g. DAPO's overlong penalty
      -> advantages, group stage          advantages.py  grpo, dr_grpo, rloo, reinforce_pp
      -> group filters                    selection.py   e.g. DAPO's dynamic sampling
    = GroupOutcome                        (`assess_groups`, when the verifiers are done)

    learner batch (whole kept groups, in start order)
      -> token masks                      selection.py   e.g. overlong: truncated, no loss
      -> advantages, batch stage          advantages.py  e.g. REINFORCE++'s normalisation
    (`token_mask`, then `batch_advantages`, before the batch is trained on)

    loss options for the next step        controllers.py e.g. kappa held to an entropy band
    (`loss_options`, then `observe(learner metrics)`; `state` / `restore` for checkpoints)

Every entry is a registry name in `RecipeSpec`, which the config's `algorithm` section builds
(`AlgorithmConfig.recipe_spec`); the policy loss and the token inspector's fields are the loss
registry's (`registry.py`, `losses.token_fields`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cagrpo_ray.algo.advantages import batch_advantages, group_advantages, lookup_estimator
from cagrpo_ray.algo.controllers import CONTROLLERS
from cagrpo_ray.algo.selection import GROUP_FILTERS, TOKEN_MASKS
from cagrpo_ray.algo.shaping import REWARD_SHAPINGS


@dataclass(frozen=True)
class RecipeSpec:
    """The recipe's entries (registry names, applied in order) and their options; built from
    the config (`AlgorithmConfig.recipe_spec`), where every default is defined."""

    group_size: int  # G, responses per prompt
    max_tokens: int  # L_max, the most tokens a response may have
    advantage_estimator: str
    overlong_buffer_len: int  # overlong_penalty's L_buf
    overlong_penalty_factor: float  # overlong_penalty's size at L_max
    max_gen_batches: int  # with a group filter: batches' worth of groups assessed per batch
    cagrpo_kappa: float  # kappa_entropy's starting kernel width
    kappa_entropy_band: tuple[float, float]
    kappa_rate: float
    kappa_range: tuple[float, float]
    reward_shaping: tuple[str, ...] = ()
    group_filters: tuple[str, ...] = ()
    token_masks: tuple[str, ...] = ()
    controllers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        estimator = lookup_estimator(self.advantage_estimator)
        if self.group_size < estimator.min_group_size:
            raise ValueError(
                f"advantage estimator {self.advantage_estimator!r} needs groups of at least "
                f"{estimator.min_group_size} responses; group_size is {self.group_size}"
            )
        for names, registry, what in (
            (self.reward_shaping, REWARD_SHAPINGS, "reward shaping"),
            (self.group_filters, GROUP_FILTERS, "group filter"),
            (self.token_masks, TOKEN_MASKS, "token mask"),
            (self.controllers, CONTROLLERS, "controller"),
        ):
            for name in names:
                if name not in registry:
                    raise ValueError(f"{what} {name!r} is not one of {', '.join(registry)}")


@dataclass(frozen=True)
class GroupOutcome:
    """One chunk's groups after the recipe, flat over responses (groups contiguous)."""

    rewards: np.ndarray  # [n] float32, shaped
    advantages: np.ndarray  # [n] float32, the estimator's group stage
    keep: list[bool]  # [num_groups]: the group enters a batch
    reshaped: int  # responses whose reward a shaping changed


class Recipe:
    """The configured entries of `spec`, called by the runtime (see the module docstring).

    Holds the controllers' state, which is part of the run's checkpoint (`state`/`restore`).
    """

    def __init__(self, spec: RecipeSpec):
        self.spec = spec
        self.controllers = {name: CONTROLLERS[name](spec) for name in spec.controllers}

    # ------------------------------------------------------------ groups, as they come in

    def assess_groups(self, rewards: Sequence[float], lengths: Sequence[int]) -> GroupOutcome:
        """Shaped rewards, advantages and the groups to keep, from the verifiers' rewards
        (one per response, groups contiguous) and each response's token count."""
        spec = self.spec
        raw = np.asarray(rewards, dtype=np.float32)
        shaped = raw
        for name in spec.reward_shaping:
            shaped = REWARD_SHAPINGS[name](shaped, np.asarray(lengths), spec)
        advantages = group_advantages(
            torch.from_numpy(shaped), spec.group_size, spec.advantage_estimator
        ).numpy()
        by_group = shaped.reshape(-1, spec.group_size)
        keep = np.ones(len(by_group), dtype=bool)
        for name in spec.group_filters:
            keep &= GROUP_FILTERS[name](by_group)
        return GroupOutcome(shaped, advantages, keep.tolist(), int((shaped != raw).sum()))

    def groups_assessed_limit(self, prompts_per_step: int) -> int | None:
        """The most groups assessed for one batch before the run stops (a filter could
        otherwise drop groups forever); None without a group filter."""
        return self.spec.max_gen_batches * prompts_per_step if self.spec.group_filters else None

    # ------------------------------------------------------------ the learner batch

    def token_mask(self, mask: Tensor, truncated: Tensor) -> Tensor:
        """The tokens trained on, [B, T] bool, from the batch's response mask and which
        responses were truncated ([B] bool)."""
        for name in self.spec.token_masks:
            mask = TOKEN_MASKS[name](mask, truncated)
        return mask

    def batch_advantages(self, advantages: Tensor, mask: Tensor) -> Tensor:
        """The advantages [B] trained on: the estimator's batch stage over the learner batch
        (the same tensor for an estimator without one); `mask` after `token_mask`."""
        return batch_advantages(advantages, mask, self.spec.advantage_estimator)

    # ------------------------------------------------------------ controllers

    def loss_options(self) -> dict[str, float] | None:
        """The loss options (`LossSpec` fields) the controllers set for the next step; None
        without controllers."""
        if not self.controllers:
            return None
        options: dict[str, float] = {}
        for controller in self.controllers.values():
            options.update(controller.loss_options())
        return options

    def observe(self, learner_metrics: dict[str, float]) -> dict[str, float]:
        """A step's learner metrics in; the controllers' metrics for that step out."""
        logged: dict[str, float] = {}
        for controller in self.controllers.values():
            logged.update(controller.observe(learner_metrics))
        return logged

    def state(self) -> dict:
        return {name: controller.state() for name, controller in self.controllers.items()}

    def restore(self, state: dict) -> None:
        for name, saved in state.items():
            if name in self.controllers:
                self.controllers[name] = type(self.controllers[name]).from_state(saved)
