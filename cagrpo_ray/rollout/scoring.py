"""From verifier results to what a group trains on: shaped rewards, advantages, and whether the
group is kept (DAPO's dynamic sampling and soft overlong penalty, Yu et al. 2025).

    overlong penalty:  r += min(-(|y| - (L_max - L_buf)) / L_buf * factor, 0)
                       |y| the response's tokens, L_max = rollout.max_tokens, L_buf the buffer
    advantages:        A_i over each group (algo.group_advantages), from the shaped rewards
    dynamic sampling:  a group whose rewards are all equal has A = 0 everywhere: no signal.
                       It is dropped and more groups are generated in its place.

The accuracy verdicts (`correct`) are the verifiers', never shaped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from cagrpo_ray.algo.advantages import group_advantages


@dataclass(frozen=True)
class ScoredGroups:
    """One chunk's groups, flat over responses (groups contiguous)."""

    rewards: np.ndarray  # [n] float32, shaped
    correct: list[bool]  # [n], the verifiers' verdicts
    advantages: np.ndarray  # [n] float32
    keep: list[bool]  # per group: train on it
    penalized: int  # responses the overlong penalty lowered


def overlong_penalty(lengths: np.ndarray, max_tokens: int, buffer_len: int, factor: float):
    """DAPO's soft overlong penalty per response (0 outside the last `buffer_len` tokens)."""
    start = max_tokens - buffer_len
    return np.minimum(-(lengths - start) / buffer_len * factor, 0.0).astype(np.float32)


def score_groups(
    results, lengths: list[int], group_size: int, algorithm, max_tokens: int
) -> ScoredGroups:
    """Shaped rewards, advantages and the groups to keep, from the verifiers' `results`
    (one per response, groups contiguous) and each response's token count."""
    rewards = np.array([r.reward for r in results], dtype=np.float32)
    penalized = 0
    if algorithm.overlong == "penalty":
        penalty = overlong_penalty(
            np.asarray(lengths, dtype=np.float32),
            max_tokens,
            algorithm.overlong_buffer_len,
            algorithm.overlong_penalty_factor,
        )
        penalized = int((penalty < 0).sum())
        rewards = (rewards + penalty).astype(np.float32)
    advantages = group_advantages(
        torch.from_numpy(rewards), group_size, std_normalize=algorithm.std_normalize
    ).numpy()
    by_group = rewards.reshape(-1, group_size)
    signal = np.ptp(by_group, axis=1) > 0
    keep = signal.tolist() if algorithm.dynamic_sampling else [True] * len(signal)
    correct = [bool(r.correct) for r in results]
    return ScoredGroups(rewards, correct, advantages, keep, penalized)


def rollout_metrics(table: pa.Table, group_size: int, multi_turn: bool = False) -> dict:
    """Reward, accuracy and length statistics of a batch taken from the buffer; with
    `multi_turn`, its episodes' turns and tool calls (`env/...`)."""
    rewards = table.column("reward").to_numpy()
    lengths = table.column("response_len").to_numpy()
    by_group = rewards.reshape(-1, group_size)
    metrics = {
        "reward/mean": float(rewards.mean()),
        "accuracy/train": float(np.mean(table.column("correct").to_numpy(zero_copy_only=False))),
        "reward/equal_reward_groups": float(np.mean(np.ptp(by_group, axis=1) == 0)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": float(
            np.mean(np.asarray(table.column("finish_reason").to_pylist()) == "length")
        ),
    }
    if multi_turn:
        column = lambda name: table.column(name).to_numpy()  # noqa: E731
        mask = table.column("policy_mask").combine_chunks().values  # null rows: no values
        env_tokens = int((~mask.to_numpy(zero_copy_only=False)).sum())
        metrics.update(
            {
                "env/turns_mean": float(column("turns").mean()),
                "env/tool_calls": int(column("tool_calls").sum()),
                "env/tool_calls_per_episode": float(column("tool_calls").mean()),
                "env/tool_errors": int(column("tool_errors").sum()),
                "env/tool_timeouts": int(column("tool_timeouts").sum()),
                "env/tool_seconds": float(column("tool_seconds").sum()),
                "env/environment_token_fraction": env_tokens / max(1, int(lengths.sum())),
            }
        )
    return metrics
