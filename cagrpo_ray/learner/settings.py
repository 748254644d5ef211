"""How one learner rank trains, apart from the loss (which is an `algo.LossSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

from cagrpo_ray.algo.schedules import LR_SCHEDULES


@dataclass(frozen=True)
class LearnerSettings:
    """How one learner rank trains, apart from the loss (which is a `LossSpec`). Each default
    is defined here once; the config field a setting comes from takes it from here
    (`config/roles.py` is the translation).

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
    """

    model_path: str
    zero_stage: int = 2
    micro_batch_size: int = 32
    lr: float = 1e-4
    warmup_steps: int = 5
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    ref_model_path: str | None = None
    max_response_length: int | None = None
    seed: int = 0
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    logits_chunk_mib: float = 1024.0
    ppo_epochs: int = 1
    mini_batches: int = 1
    token_stats: str = "rollout"
    measure_policy_change: bool = False
    length_buckets: int = 4
    share_prompts: bool = True
    num_threads: int = 1
    dist_timeout_s: float = 1800.0

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
