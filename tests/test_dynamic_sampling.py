"""DAPO's dynamic sampling end to end (real Ray, vLLM, DeepSpeed on the CPU): no batch holds a
group whose rewards are all equal, and a task that only ever gives equal rewards stops with a
clear error after its bound instead of generating forever."""

from __future__ import annotations

import pytest
from short_run import PROMPTS, STEPS

from cagrpo_ray.config import load_config
from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.schedule import DynamicSamplingError

pytestmark = [pytest.mark.integration, pytest.mark.preset]


def overrides(tmp_path, name, *extra):
    return [
        "model.path=chain_sum",
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        "run.steps=3",
        "run.checkpoint_every=0",
        "run.save_policy=never",
        "data.eval_size=8",
        "eval.samples=2",
        "metrics.port=0",
        "algorithm.dynamic_sampling=true",
        *extra,
    ]


def test_no_batch_holds_a_group_without_signal(short_run):
    """The session's short run (tests/short_run.py) has dynamic sampling on."""
    assert short_run.returncode == 0, short_run.console[-4000:]
    records = read_metrics(short_run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["reward/equal_reward_groups"] == 0.0 for r in records)
    # groups were dropped (about half have equal rewards on this task) and replaced
    assert sum(r["dynamic_sampling/filtered_groups"] for r in records) > 0
    assert all(r["dynamic_sampling/scored_groups"] >= PROMPTS for r in records)


def test_a_task_without_signal_stops_at_the_bound(shared_ray, tmp_path):
    # the format reward alone: (nearly) every response is well-formed, so groups tie
    config = load_config(
        "configs/cpu-tiny.yaml",
        overrides(
            tmp_path,
            "flat",
            "reward.weights={format: 1.0}",
            "algorithm.max_gen_batches=2",
            "rollout.enforce_eager=true",
            # one replica and one rank: the bound is the scheduler's, and the run stops in its
            # first step's generation (two of each: the short run above)
            "rollout.num_generators=1",
            "learner.num_learners=1",
        ),  # fmt: skip
    )
    with pytest.raises(DynamicSamplingError, match=r"algorithm.max_gen_batches is 2"):
        Trainer(config).run()
