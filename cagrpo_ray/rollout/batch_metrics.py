"""Statistics of a training batch taken from the buffer: rewards, accuracy, lengths, and a
multi-turn episode's turns and tool calls.

What a group trains on (shaped rewards, advantages, which groups and tokens are kept) is the
recipe's: `cagrpo_ray/algo/recipe.py`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


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
