"""Rules that span sections, checked once the tree has validated; each message names the keys
and what would be right."""

from __future__ import annotations

from cagrpo_ray.config.sections import Config


def check_across_sections(config: Config) -> Config:
    """Rules that span sections; each message names the keys and what would be right."""
    if config.model.dtype == "bfloat16" and config.learner.zero_stage == 0:
        raise ValueError(
            "model.dtype bfloat16 needs learner.zero_stage 1, 2 or 3: DeepSpeed accumulates "
            "stage 0's gradients in bfloat16 only, and the learner accumulates in float32"
        )
    a, r, lcfg = config.algorithm, config.rollout, config.learner
    batch = r.prompts_per_step * r.group_size
    if a.mini_batch_size is not None:
        size = a.mini_batch_size
        if size % r.group_size or batch % size or (size // r.group_size) % lcfg.num_learners:
            raise ValueError(
                f"algorithm.mini_batch_size {size} must hold whole prompt groups "
                f"(rollout.group_size {r.group_size}), divide the rollout batch "
                f"({r.prompts_per_step} x {r.group_size} = {batch} responses) and split evenly "
                f"over the {lcfg.num_learners} learner ranks"
            )
    overlong_penalty = a.overlong == "penalty" or "overlong_penalty" in a.reward_shaping
    if overlong_penalty and not 0 < a.overlong_buffer_len <= r.max_tokens:
        raise ValueError(
            f"the overlong penalty (algorithm.overlong 'penalty', or 'overlong_penalty' in "
            f"algorithm.reward_shaping) needs 0 < algorithm.overlong_buffer_len <= "
            f"rollout.max_tokens ({r.max_tokens}), got {a.overlong_buffer_len}"
        )
    for key, value in (
        ("rollout.num_gpus_per_generator", config.rollout.num_gpus_per_generator),
        ("learner.num_gpus_per_learner", config.learner.num_gpus_per_learner),
    ):
        if value != int(value):
            raise ValueError(
                f"{key}: {value:g} is a fraction of a GPU, which would put two actors (and two "
                "ranks of the weight-sync group) on one GPU; NCCL refuses that and colocated "
                "layouts are not supported: use whole GPUs (0 on the CPU)"
            )
    if config.eval.hard_config and config.data.source != "reasoning_gym":
        raise ValueError(
            "eval.hard_config describes a harder reasoning_gym split; data.source is "
            f"{config.data.source!r} (put harder problems in their own file and evaluate it with "
            "python -m cagrpo_ray.eval, or leave eval.hard_config empty)"
        )
    if r.weight_update == "in_flight" and r.engine != "vllm":
        raise ValueError(
            f"rollout.weight_update 'in_flight' needs rollout.engine 'vllm' (got {r.engine!r}): "
            "the HF engine runs one request at a time and has nothing to freeze; use 'drain'"
        )
    if config.sync.timeout_s >= config.learner.dist_timeout_s:
        raise ValueError(
            f"sync.timeout_s ({config.sync.timeout_s:g}) must be below learner.dist_timeout_s "
            f"({config.learner.dist_timeout_s:g}): learner ranks wait in a collective while rank "
            "0 waits for the generators"
        )
    return config
