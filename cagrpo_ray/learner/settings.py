"""What one learner rank is told, and the one translation of the config into it: the rank's
`LearnerSettings` and the loss's `LossSpec` (`learner_settings`, `loss_spec`).

Each default is defined once. A setting copied from a config key takes that key's default
(`LEARNER_KEYS`; the config is one layer below the roles), and a loss option's config key
takes the option's default from `LossSpec` (`algo/` imports nothing; config/algorithm.py), so
no two can disagree (tests/test_settings.py checks it). The values the config does not state
directly are derived here, where they are used, and the config keeps what the user wrote:

- `algorithm.tis_cap` None: `DEFAULT_TIS_CAP` when the schedule is asynchronous
  (run.max_staleness > 0), no correction when it is synchronous; 0: no correction.
- the mini-batches per pass: the rollout batch over `algorithm.mini_batch_size`.
- Dr.GRPO's constant L: `rollout.max_tokens`; the decay horizon of the lr schedule: `run.steps`.
- the adapter: `model.lora` as a `LoraSpec` (None when model.lora.rank is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from cagrpo_ray.algo.registry import LossSpec
from cagrpo_ray.algo.schedules import LR_SCHEDULES
from cagrpo_ray.config import DEFAULT_TIS_CAP, Config
from cagrpo_ray.policies.lora import LoraSpec

# LearnerSettings field -> the config key whose value (and default) it takes. The other fields
# are DERIVED from several keys by `learner_settings`, or NOT_IN_CONFIG.
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
DERIVED = ("model_path", "max_response_length", "total_steps", "mini_batches", "lora", "plugins")
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


def _config_default(field: str):
    """The default of the config key LearnerSettings field `field` comes from: its one
    definition."""
    section, name = LEARNER_KEYS[field].split(".")
    return Config.model_fields[section].annotation.model_fields[name].default


@dataclass(frozen=True)
class LearnerSettings:
    """How one learner rank trains, apart from the loss (which is a `LossSpec`). A setting
    copied from a config key has that key's default (`LEARNER_KEYS`).

    model_path: the policy to start from (a Hugging Face model directory).
    zero_stage: DeepSpeed ZeRO stage 0 to 3.
    micro_batch_size: responses per forward/backward pass.
    lr, warmup_steps, weight_decay, grad_clip: AdamW with linear warm-up to lr.
    lr_schedule, min_lr_ratio, total_steps: after the warm-up, "constant", or "linear" /
        "cosine" decay to min_lr_ratio * lr at scheduler step total_steps, which those two
        need (DeepSpeed steps the scheduler with every optimizer step; `algo.schedules`).
    temperature: the sampling temperature; log-probs are of log_softmax(logits / temperature).
    ref_model_path: the frozen reference policy for the KL penalty (None: the starting policy,
        loaded only when the loss's kl_coef > 0).
    max_response_length: Dr.GRPO's constant L (None: the longest response of each batch).
    seed: learner RNG and Clip-Cov's draws.
    dtype: parameter dtype, the generators' too ("float32" or "bfloat16"; float16 would need
        loss scaling, which is not implemented). bfloat16 trains with fp32 master weights and
        fp32 gradient accumulation (ZeRO stage 1 and up).
    lora: the low-rank adapter to train on the frozen base (None: full fine-tuning). The base
        stays in `dtype` with no gradient or optimizer state; the adapter, its gradients and
        its optimizer state are float32.
    gradient_checkpointing: recompute each decoder layer in the backward pass instead of
        keeping its activations (non-reentrant; the model stays in train mode, dropout 0).
    logits_chunk_mib: memory for one chunk of the output head's float32 work (`logprobs.py`).
    ppo_epochs: passes over each rollout batch.
    mini_batches: optimizer steps per pass (each over 1 / mini_batches of the batch).
    token_stats: "rollout" (the loss's batch statistics fixed once per rollout batch from the
        old policy) or "minibatch" (recomputed per mini-batch from the current policy).
    measure_policy_change: one more forward pass of the batch after the step: KL(before || after).
    length_buckets: when a rank's batch fits one micro-batch and the step is one update, its
        training pass runs in this many length-sorted parts (all kept for the backward pass)
        and doubles as the proximal pass.
    share_prompts: run the prompt a group's responses share once per micro-batch, the
        responses packed after it, where that costs the decoder less than one padded row per
        response (`learner/packing.py`); micro-batches then hold whole groups.
    num_threads: torch CPU threads of this rank.
    dist_timeout_s: timeout of the data-parallel collectives.
    plugins: the config's `algorithm.plugins`, imported by each rank before it trains (a loss
        of the user's own is looked up in the rank's process).
    """

    model_path: str
    zero_stage: int = _config_default("zero_stage")
    micro_batch_size: int = _config_default("micro_batch_size")
    lr: float = _config_default("lr")
    warmup_steps: int = _config_default("warmup_steps")
    lr_schedule: str = _config_default("lr_schedule")
    min_lr_ratio: float = _config_default("min_lr_ratio")
    total_steps: int | None = None
    weight_decay: float = _config_default("weight_decay")
    grad_clip: float = _config_default("grad_clip")
    temperature: float = _config_default("temperature")
    ref_model_path: str | None = None
    max_response_length: int | None = None
    seed: int = _config_default("seed")
    dtype: str = _config_default("dtype")
    gradient_checkpointing: bool = _config_default("gradient_checkpointing")
    logits_chunk_mib: float = _config_default("logits_chunk_mib")
    ppo_epochs: int = _config_default("ppo_epochs")
    mini_batches: int = 1
    token_stats: str = _config_default("token_stats")
    measure_policy_change: bool = _config_default("measure_policy_change")
    length_buckets: int = _config_default("length_buckets")
    share_prompts: bool = _config_default("share_prompts")
    num_threads: int = 1
    dist_timeout_s: float = _config_default("dist_timeout_s")
    lora: LoraSpec | None = None
    plugins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.temperature <= 0:
            raise ValueError(
                f"temperature must be positive (the sampling one), got {self.temperature}"
            )
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(
                f"ppo_epochs and mini_batches must be >= 1, got {self.ppo_epochs}, "
                f"{self.mini_batches}"
            )
        if self.token_stats not in ("rollout", "minibatch"):
            raise ValueError(f"token_stats {self.token_stats!r} is not one of rollout, minibatch")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule {self.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}"
            )
        if self.lr_schedule != "constant" and (self.total_steps is None or self.total_steps < 1):
            raise ValueError(
                f"lr_schedule {self.lr_schedule!r} decays over total_steps, which must be >= 1; "
                f"got {self.total_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"dtype {self.dtype!r} is not one of float32, bfloat16 (float16 needs loss "
                "scaling, which the learner does not implement)"
            )
        if self.dtype == "bfloat16" and self.zero_stage == 0:
            raise ValueError(
                "bfloat16 needs ZeRO stage 1 or more: DeepSpeed accumulates stage 0's "
                "gradients in bfloat16 only, and the learner accumulates in float32"
            )


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
        lora=LoraSpec.from_config(config.model.lora),
        plugins=tuple(a.plugins),
        **{field: config_value(config, key) for field, key in LEARNER_KEYS.items()},
    )
