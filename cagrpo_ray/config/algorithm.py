"""The `algorithm` section of the configuration: the policy loss and its options, the
optimizer's schedule, the advantage and the controllers (`cagrpo_ray/config/sections.py` holds
the others)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from cagrpo_ray.algo.advantages import ADVANTAGE_ESTIMATORS
from cagrpo_ray.algo.controllers import CONTROLLERS
from cagrpo_ray.algo.losses import (
    CAGRPO_KERNELS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    LossSpec,
)
from cagrpo_ray.algo.recipe import RecipeSpec
from cagrpo_ray.algo.registries import Registry
from cagrpo_ray.algo.schedules import LR_SCHEDULES
from cagrpo_ray.algo.selection import GROUP_FILTERS, TOKEN_MASKS
from cagrpo_ray.algo.shaping import REWARD_SHAPINGS
from cagrpo_ray.algo.stats import SCOPES
from cagrpo_ray.config.plugins import PluginError, load_plugins, resolve
from cagrpo_ray.config.section import Section

DEFAULT_TIS_CAP = 2.0  # the truncation asynchronous runs get unless they say otherwise


def registered_names(registry: Registry, names):
    """`names` (one name or a list of them) if `registry` holds each, else the config error
    that lists what it holds (plugins included: they are imported before any check)."""
    for name in [names] if isinstance(names, str) else names:
        if name not in registry:
            raise PydanticCustomError(
                "registry_name",
                "{name} is not one of {allowed}",
                {"name": repr(name), "allowed": ", ".join(registry)},
            )
    return names


class AlgorithmConfig(Section):
    # the fields whose values are a registry's names (`--describe` lists them)
    registries: ClassVar[dict[str, Registry]] = {
        "policy_loss": POLICY_LOSSES,
        "advantage_estimator": ADVANTAGE_ESTIMATORS,
        "reward_shaping": REWARD_SHAPINGS,
        "group_filters": GROUP_FILTERS,
        "token_masks": TOKEN_MASKS,
        "controllers": CONTROLLERS,
    }

    plugins: list[str] = Field(
        [],
        description="Your own algorithm entries: Python files (path/to/my_algo.py, relative to "
        "the working directory) or importable modules that register estimators, losses, "
        "reward shapings, group filters, token masks or controllers; imported before the "
        "config is checked, in the driver and in every learner rank, so that their names are "
        "values of the keys below (docs/extending.md).",
    )
    policy_loss: str = Field(
        LossSpec.name, description="Policy loss from the registry in cagrpo_ray.algo.losses."
    )
    loss_agg: Literal[LOSS_AGG_MODES] = Field(
        LossSpec.loss_agg,
        description="How token losses become the loss, over the whole batch: token-mean (every "
        "token alike; DAPO), seq-mean-token-mean (every response alike; GRPO), "
        "seq-mean-token-sum (per-response sums averaged over responses), "
        "seq-mean-token-sum-norm (sums over responses x rollout.max_tokens; Dr.GRPO).",
    )
    cov_scope: Literal[SCOPES] = Field(
        LossSpec.cov_scope, description="Token set over which CA-GRPO's covariance kernel is taken."
    )
    cagrpo_kernel: Literal[CAGRPO_KERNELS] = Field(
        LossSpec.cagrpo_kernel,
        description="CA-GRPO's weights: normalized (the paper's w~); the ablations unnormalized "
        "(raw Gaussian kernel w), ones (every weight 1, which is GRPO), positive and negative "
        "(the kernel on the tokens with c > 0, resp. c < 0, only).",
    )
    cagrpo_kappa: float = Field(
        LossSpec.cagrpo_kappa,
        gt=0,
        description="CA-GRPO's kernel width in units of sigma: w = exp(-c^2 / (2 kappa^2 "
        "sigma^2)); 1 is the paper's, larger is closer to GRPO. With kappa_control 'entropy', "
        "the controller's starting value.",
    )
    kappa_control: Literal["off", "entropy"] = Field(
        "off",
        description="CA-GRPO's kappa steered step by step to hold the learner's token entropy "
        "within kappa_entropy_band of the first step's (algo/controllers.py), or fixed.",
    )
    kappa_entropy_band: tuple[float, float] = Field(
        (0.85, 1.15),
        description="The controller's target band for entropy, as fractions of the first "
        "step's: above it kappa grows (towards GRPO, whose entropy falls), below it shrinks.",
    )
    kappa_rate: float = Field(
        0.1, gt=0, description="The controller's step: kappa is multiplied or divided by e^rate."
    )
    kappa_range: tuple[float, float] = Field(
        (0.25, 64.0), description="The controller keeps kappa within [low, high]."
    )
    clip_cov_ratio: float = Field(
        LossSpec.clip_cov_ratio,
        ge=0,
        le=1,
        description="Clip-Cov: fraction of tokens whose gradient is cut.",
    )
    clip_cov_lb: float = Field(
        LossSpec.clip_cov_lb,
        description="Clip-Cov: lower bound of the covariance band tokens are drawn from.",
    )
    clip_cov_ub: float = Field(
        LossSpec.clip_cov_ub,
        description="Clip-Cov: upper bound of the covariance band tokens are drawn from.",
    )
    kl_cov_ratio: float = Field(
        LossSpec.kl_cov_ratio,
        ge=0,
        le=1,
        description="KL-Cov: fraction of tokens (largest covariance) that get the |log r| "
        "penalty (the authors' 7B recipe: 2e-3).",
    )
    kl_cov_coef: float = Field(
        LossSpec.kl_cov_coef,
        ge=0,
        description="KL-Cov: coefficient of |log r| (the authors' code and verl's recipes use 1; "
        "verl's dataclass default is 0.1).",
    )
    advantage_estimator: str = Field(
        "grpo",
        description="How a response's advantage comes from its group's rewards, from the "
        "registry in cagrpo_ray.algo.advantages (docs/extending.md).",
    )
    clip_eps_low: float = Field(LossSpec.clip_eps_low, ge=0, description="PPO clip range below 1.")
    clip_eps_high: float = Field(
        LossSpec.clip_eps_high, ge=0, description="PPO clip range above 1 (DAPO: 0.28)."
    )
    clip_ratio_c: float | None = Field(
        LossSpec.clip_ratio_c,
        gt=1,
        description="Dual-clip: a token with negative advantage A loses at most |A| * c, so a "
        "ratio far above 1 cannot dominate the update (verl's clip_ratio_c; its DAPO recipes use "
        "10). Never binds at ratio 1. PPO-clip losses only (grpo, cagrpo, clip_cov). None: off.",
    )
    lr: float = Field(1e-4, gt=0, description="Learning rate (AdamW).")
    warmup_steps: int = Field(
        5,
        ge=0,
        description="Linear learning-rate warm-up steps: lr * (s + 1) / warmup_steps at step s.",
    )
    lr_schedule: Literal[LR_SCHEDULES] = Field(
        "constant",
        description="Learning rate after the warm-up: constant, or linear / cosine decay towards "
        "min_lr_ratio * lr at the end of the run (verl's lr_scheduler_type).",
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Where linear and cosine decay end, as a fraction of lr.",
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    kl_coef: float = Field(
        LossSpec.kl_coef,
        ge=0,
        description="Coefficient of the KL penalty to the reference policy, a loss term (0: off).",
    )
    kl_estimator: Literal[KL_ESTIMATORS] = Field(
        LossSpec.kl_estimator,
        description="Per-token KL estimator, d = log pi - log pi_ref: k1 (d), abs (|d|), k2 "
        "(d^2 / 2), k3 (e^-d + d - 1, clamped to 10; verl's low_var_kl).",
    )
    entropy_coef: float = Field(
        LossSpec.entropy_coef, ge=0, description="Entropy bonus coefficient (0: off)."
    )
    tis_cap: float | None = Field(
        LossSpec.tis_cap,
        ge=0,
        description="Truncated importance-sampling cap on behavior->proximal weights. None: "
        f"{DEFAULT_TIS_CAP:g} "
        "when run.max_staleness > 0 (asynchronous samples need the correction), off when 0; "
        "0: no correction, whatever the schedule (an explicit choice).",
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Passes over each rollout batch (verl's ppo_epochs).",
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Responses per optimizer step, over all learner ranks (whole groups; None: "
        "the whole rollout batch, one optimizer step per pass).",
    )
    token_stats: Literal["rollout", "minibatch"] = Field(
        "rollout",
        description="Where CA-GRPO's kernel weights and the Clip-Cov/KL-Cov selections come "
        "from: once per rollout batch from the old policy, or per mini-batch from the current "
        "policy (as verl does).",
    )
    measure_policy_change: bool = Field(
        False,
        description="After each learner step, run its batch through the policy again to log the KL "
        "between the policies before and after it (policy/kl_step; one more forward pass).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: drop groups whose rewards are all equal (no "
        "signal) and keep generating until the batch is full.",
    )
    max_gen_batches: int = Field(
        10,
        ge=1,
        description="Dynamic sampling: at most this many batches' worth of groups are scored "
        "for one batch before the run stops with an error.",
    )
    overlong: Literal["none", "mask", "penalty"] = Field(
        "none",
        description="Truncated responses: trained as they are, masked out of the loss, or "
        "DAPO's soft overlong penalty on the reward.",
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="Overlong penalty: the last this many tokens before rollout.max_tokens "
        "where the penalty ramps from 0 to -overlong_penalty_factor.",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="Overlong penalty: its size at rollout.max_tokens."
    )
    reward_shaping: list[str] = Field(
        [],
        description="Reward shapings by registry name, applied in this order to the "
        "verifiers' rewards before the advantages (overlong: penalty adds overlong_penalty).",
    )
    group_filters: list[str] = Field(
        [],
        description="Group filters by registry name: a group any of them rejects is not "
        "trained, and generation goes on until the batch is full (dynamic_sampling: true adds "
        "dynamic_sampling).",
    )
    token_masks: list[str] = Field(
        [],
        description="Token masks by registry name, applied in this order to the batch's loss "
        "mask (overlong: mask adds overlong).",
    )
    controllers: list[str] = Field(
        [],
        description="Controllers by registry name, which set loss options step by step from "
        "the learner's metrics (kappa_control: entropy adds kappa_entropy).",
    )

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data):
        """The plugins first, so that the names they register are valid values of this
        section; a `.py` plugin is kept by its absolute path, for the learner ranks."""
        if isinstance(data, dict) and data.get("plugins"):
            plugins = data["plugins"]
            if isinstance(plugins, str):
                plugins = [plugins]
            if not isinstance(plugins, list | tuple) or not all(
                isinstance(p, str) for p in plugins
            ):
                raise ValueError(
                    f"algorithm.plugins must be a list of files or modules, got {plugins!r}"
                )
            try:
                load_plugins(plugins)
            except PluginError as error:  # the key is named where the message is shown
                raise PydanticCustomError("plugin", "{message}", {"message": str(error)}) from None
            data = {**data, "plugins": [resolve(p) for p in plugins]}
        return data

    @field_validator("policy_loss", "advantage_estimator", "reward_shaping", "group_filters",
                     "token_masks", "controllers")  # fmt: skip
    @classmethod
    def _registered(cls, names, info):
        return registered_names(cls.registries[info.field_name], names)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "std_normalize" in data:
            raise ValueError(
                "algorithm.std_normalize is replaced by algorithm.advantage_estimator: "
                "std_normalize true is advantage_estimator grpo, false is dr_grpo"
            )
        return data

    @model_validator(mode="after")
    def _kappa_controlled(self) -> AlgorithmConfig:
        low, high = self.kappa_entropy_band
        if not 0 < low < 1 < high:
            raise ValueError(
                f"algorithm.kappa_entropy_band must be (low, high) with 0 < low < 1 < high, got "
                f"{self.kappa_entropy_band}"
            )
        low, high = self.kappa_range
        if not 0 < low <= self.cagrpo_kappa <= high:
            raise ValueError(
                f"algorithm.kappa_range {self.kappa_range} must contain cagrpo_kappa "
                f"{self.cagrpo_kappa} (and be positive)"
            )
        steered = self.kappa_control != "off" or "kappa_entropy" in self.controllers
        if steered and self.policy_loss != "cagrpo":
            raise ValueError(
                f"algorithm.kappa_control {self.kappa_control!r} (or the controller "
                f"kappa_entropy) steers CA-GRPO's kernel; policy_loss is {self.policy_loss!r} "
                "(use cagrpo, or kappa_control: off)"
            )
        return self

    def recipe_spec(self, group_size: int, max_tokens: int) -> RecipeSpec:
        """What is trained besides the loss (`algo/recipe.py`): the registry entries these
        fields select, with their options; `group_size` and `max_tokens` are the rollout's."""
        return RecipeSpec(
            group_size=group_size,
            max_tokens=max_tokens,
            advantage_estimator=self.advantage_estimator,
            overlong_buffer_len=self.overlong_buffer_len,
            overlong_penalty_factor=self.overlong_penalty_factor,
            max_gen_batches=self.max_gen_batches,
            cagrpo_kappa=self.cagrpo_kappa,
            kappa_entropy_band=self.kappa_entropy_band,
            kappa_rate=self.kappa_rate,
            kappa_range=self.kappa_range,
            reward_shaping=_names(
                self.overlong == "penalty", "overlong_penalty", self.reward_shaping
            ),
            group_filters=_names(self.dynamic_sampling, "dynamic_sampling", self.group_filters),
            token_masks=_names(self.overlong == "mask", "overlong", self.token_masks),
            controllers=_names(self.kappa_control == "entropy", "kappa_entropy", self.controllers),
        )


def _names(switched_on: bool, name: str, listed: list[str]) -> tuple[str, ...]:
    """A recipe stage's registry names: the one its switch adds (a shipped config's spelling),
    then those listed by name, each once, in order."""
    return tuple(dict.fromkeys(([name] if switched_on else []) + list(listed)))
