"""Non-default advantage estimators train end to end (real Ray, vLLM, DeepSpeed on the CPU):
two steps of the embedded default config with `algorithm.advantage_estimator` set, every
group inspected, and the advantages the learner trained on (the inspector's) checked against
the estimator's definition written out here, from the rewards and trained tokens of the same
records: RLOO's leave-one-out baseline (group stage only), and REINFORCE++-baseline, whose
normalisation over the whole learner batch is applied by the scheduler before training; and
an estimator and a loss that exist only in this test's own file (`algorithm.plugins`), the
loss looked up in the learner rank's process, which imported the file itself."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

from cagrpo_ray.config import load_config
from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.inspect.records import read_step
from cagrpo_ray.metrics.jsonl import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.preset]

STEPS, PROMPTS, GROUP = 2, 4, 8


def rloo(rewards: np.ndarray) -> np.ndarray:
    """[groups, G] -> [groups, G]: r_i minus the mean of the other rewards of its group."""
    rewards = rewards.astype(np.float64)
    out = np.empty_like(rewards)
    for g, row in enumerate(rewards):
        for i in range(len(row)):
            out[g, i] = row[i] - np.delete(row, i).mean()
    return out


def reinforce_pp(rewards: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[groups, G] rewards and trained tokens -> the group-mean-centred rewards, normalised
    by the mean and population std of the values the batch's trained tokens carry."""
    centred = rewards.astype(np.float64) - rewards.astype(np.float64).mean(axis=1, keepdims=True)
    per_token = np.repeat(centred.reshape(-1), tokens.reshape(-1))
    return (centred - per_token.mean()) / max(per_token.var(), 1e-8) ** 0.5


def median_baseline(rewards: np.ndarray) -> np.ndarray:
    """[groups, G] -> r_i minus the lower median of its group (torch.median's for even G)."""
    rewards = rewards.astype(np.float64)
    lower_median = np.sort(rewards, axis=1)[:, (rewards.shape[1] - 1) // 2]
    return rewards - lower_median[:, None]


# A user's own algorithm, in a file of their own: nothing of the package is edited.
PLUGIN = """
from cagrpo_ray.algo import register_advantage_estimator, register_policy_loss

@register_advantage_estimator("test_median_baseline", min_group_size=2)
def median_baseline(rewards):
    return rewards - rewards.median(dim=1, keepdim=True).values

@register_policy_loss("test_reinforce")
def reinforce(x):
    tokens = float(x.mask.sum())
    return -x.advantages * x.ratio, {"policy/test_reinforce_tokens": tokens}
"""


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "plugin"])
def test_an_estimator_trains_on_its_own_advantages(kept_generators, tmp_path, estimator):
    algorithm = [f"algorithm.advantage_estimator={estimator}"]
    if estimator == "plugin":
        (tmp_path / "my_algo.py").write_text(textwrap.dedent(PLUGIN))
        algorithm = [
            f"algorithm.plugins=[{tmp_path / 'my_algo.py'}]",
            "algorithm.advantage_estimator=test_median_baseline",
            "algorithm.policy_loss=test_reinforce",
        ]
    config = load_config(
        "configs/cpu-tiny.yaml",
        [
            "model.path=chain_sum",
            *algorithm,
            f"run.output_dir={tmp_path}",
            f"run.name={estimator}",
            f"run.steps={STEPS}",
            "run.checkpoint_every=0",
            "run.save_policy=never",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            "rollout.enforce_eager=true",
            "rollout.num_generators=1",
            "learner.num_learners=1",
            "data.eval_size=4",
            "eval.samples=1",
            "metrics.port=0",
            "metrics.inspect_every=1",
            f"metrics.inspect_groups={PROMPTS}",  # every group of every batch
            "metrics.inspect_port=null",
        ],
    )
    trainer = Trainer(config, kept_generators=kept_generators)  # both runs on one replica
    trainer.run()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss/total"]) and math.isfinite(r["policy/loss"]) for r in records)
    if estimator == "plugin":  # the plugin's loss ran in the learner rank: its metric is there
        assert all(r["policy/test_reinforce_tokens"] > 0 for r in records), records[0].keys()
    signal = 0
    for step in range(1, STEPS + 1):
        table, metadata = read_step(trainer.run_dir, step)
        assert metadata["policy_loss"] == config.algorithm.policy_loss
        assert table.num_rows == PROMPTS * GROUP
        rows = table.sort_by([("group_id", "ascending"), ("response_index", "ascending")])
        rewards = rows.column("reward").to_numpy().reshape(PROMPTS, GROUP)
        trained = rows.column("advantage").to_numpy().reshape(PROMPTS, GROUP)
        tokens = np.array([len(t) for t in rows.column("tokens").to_pylist()])
        if estimator == "plugin":
            want = median_baseline(rewards)
        else:
            want = rloo(rewards) if estimator == "rloo" else reinforce_pp(rewards, tokens)
        np.testing.assert_allclose(trained, want, rtol=1e-5, atol=1e-5)
        signal += int((np.ptp(rewards, axis=1) > 0).sum())
    assert signal > 0  # some group had rewards that differ: the advantages were not all 0
