"""The one translation from the config to the roles' settings: the loss's `LossSpec` and the
learner's `LearnerSettings`.

Each default is defined once, in the role's dataclass: a config field copied into a role takes
its default from the role's field (`lr: float = Field(LearnerSettings.lr, ...)`), so the two
cannot disagree (tests/test_config_roles.py checks it). The values the config does not state
directly are derived here, where they are used, and the config keeps what the user wrote:

- `algorithm.tis_cap` None: `DEFAULT_TIS_CAP` when the schedule is asynchronous
  (run.max_staleness > 0), no correction when it is synchronous; 0: no correction.
- the learner's mini-batches per pass: the rollout batch over `algorithm.mini_batch_size`.
- Dr.GRPO's constant L: `rollout.max_tokens`; the decay horizon of the lr schedule: `run.steps`.
"""

from __future__ import annotations

from cagrpo_ray.algo.registry import LossSpec
from cagrpo_ray.config.sections import Config
from cagrpo_ray.learner.settings import LearnerSettings

DEFAULT_TIS_CAP = 2.0  # the truncation asynchronous runs get unless they say otherwise

# LearnerSettings field -> the config key whose value it takes (that field's default is this
# one's). `learner_settings` fills the others: DERIVED from several keys, or NOT_IN_CONFIG.
LEARNER_KEYS = {
    "zero_stage": "learner.zero_stage",
    "micro_batch_size": "learner.micro_batch_size",
    "lr": "algorithm.lr",
    "warmup_steps": "algorithm.warmup_steps",
    "lr_schedule": "algorithm.lr_schedule",
    "min_lr_ratio": "algorithm.min_lr_ratio",
    "weight_decay": "algorithm.weight_decay",
    "grad_clip": "algorithm.grad_clip",
    "temperature": "rollout.temperature",
    "seed": "run.seed",
    "dtype": "model.dtype",
    "gradient_checkpointing": "learner.gradient_checkpointing",
    "logits_chunk_mib": "learner.logits_chunk_mib",
    "ppo_epochs": "algorithm.ppo_epochs",
    "token_stats": "algorithm.token_stats",
    "measure_policy_change": "algorithm.measure_policy_change",
    "length_buckets": "learner.length_buckets",
    "share_prompts": "learner.share_prompts",
    "dist_timeout_s": "learner.dist_timeout_s",
}
DERIVED = ("model_path", "max_response_length", "total_steps", "mini_batches")
NOT_IN_CONFIG = ("ref_model_path", "num_threads")  # set by tests, benchmarks and the group

# LossSpec field -> the config key whose value it takes: `name` is algorithm.policy_loss, every
# option algorithm.<option> (tis_cap resolved by `loss_spec`).
LOSS_KEYS = {"name": "algorithm.policy_loss"} | {
    option: f"algorithm.{option}" for option in LossSpec.option_names()
}


def config_value(config: Config, key: str):
    """The value of a dotted config key, e.g. `config_value(config, "algorithm.lr")`."""
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def tis_cap(config: Config) -> float | None:
    """The truncated-IS cap the loss uses (see the module docstring); None: no correction."""
    cap = config.algorithm.tis_cap
    if cap is None:
        return DEFAULT_TIS_CAP if config.run.max_staleness > 0 else None
    return cap or None  # 0: explicitly off


def loss_spec(config: Config) -> LossSpec:
    """The loss and all its options as one typed value, for the learner."""
    values = {field: config_value(config, key) for field, key in LOSS_KEYS.items()}
    values["tis_cap"] = tis_cap(config)
    return LossSpec(**values)


def learner_settings(config: Config, model_path: str) -> LearnerSettings:
    """The learners' `LearnerSettings` (the loss is `loss_spec`), for the policy at
    `model_path` (the folder every role loads)."""
    r, a = config.rollout, config.algorithm
    responses = r.prompts_per_step * r.group_size
    return LearnerSettings(
        model_path=model_path,
        max_response_length=r.max_tokens,
        total_steps=config.run.steps,
        mini_batches=responses // (a.mini_batch_size or responses),
        **{field: config_value(config, key) for field, key in LEARNER_KEYS.items()},
    )
