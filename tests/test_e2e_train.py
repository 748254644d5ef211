"""End to end on the CPU: the warm-started small policy, 2 vLLM generators, 2 DeepSpeed ranks.

One uninterrupted run of N steps is the reference. It must raise held-out accuracy by a margin
that a paired test over the held-out prompts justifies. A second run resumes from the first
run's checkpoint at step N/2, has a generator replica killed mid-run, and must reproduce the
reference's per-step metrics for steps N/2+1..N, with the replacement serving the current
policy version.
"""

from __future__ import annotations

import math
import shutil
import threading
import time

import numpy as np
import pytest
import ray

from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.trainer import Trainer

pytestmark = pytest.mark.integration

STEPS = 30
# Metrics that depend only on the data, the seeds and the weights (not on timing).
DETERMINISTIC = [
    "reward/mean",
    "accuracy/train",
    "response/length_mean",
    "entropy/mean",
    "policy/loss",
    "learner/grad_norm",
    "cov/std",
    "cagrpo/weight_min",
    "data/cursor",
]


def overrides(tmp_path, name):
    return [
        "model.path=chain_sum",  # the built-in preset: built once, then taken from the cache
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        f"run.steps={STEPS}",
        f"run.checkpoint_every={STEPS // 2}",
        "run.keep_checkpoints=4",
        "rollout.prompts_per_step=16",
        "rollout.group_size=8",
        "data.eval_size=200",
        "eval.samples=4",
        "metrics.port=0",
        "sync.timeout_s=20",
    ]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=3, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference_run(local_ray, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("e2e")
    config = load_config("configs/cpu-tiny.yaml", overrides(tmp_path, "reference"))
    summary = Trainer(config).run()
    return tmp_path, summary


def test_training_raises_heldout_accuracy(reference_run):
    _, summary = reference_run
    before = summary["eval_before"]["per_prompt"]
    after = summary["eval_after"]["per_prompt"]
    assert [p["uid"] for p in before] == [p["uid"] for p in after]
    samples = summary["eval_before"]["samples"]
    # Paired over the same 200 held-out prompts: d_i = accuracy after - before on prompt i.
    d = np.array(
        [
            (a["num_correct"] - b["num_correct"]) / samples
            for a, b in zip(after, before, strict=True)
        ]
    )
    se = d.std(ddof=1) / math.sqrt(len(d))
    # One-sided 99% bound: the gain is real if its mean exceeds 2.33 standard errors.
    assert d.mean() > 2.33 * se, (
        f"held-out pass@1 {summary['eval_before']['pass@1']:.3f} -> "
        f"{summary['eval_after']['pass@1']:.3f}; paired gain {d.mean():.3f} +- {se:.3f}"
    )


def test_resume_with_a_killed_generator_reproduces_the_reference(reference_run):
    tmp_path, _ = reference_run
    resumed_dir = tmp_path / "resumed"
    halfway = f"step_{STEPS // 2:06d}"
    shutil.copytree(
        tmp_path / "reference" / "checkpoints" / halfway, resumed_dir / "checkpoints" / halfway
    )
    (resumed_dir / "checkpoints" / "latest").write_text(halfway)
    reference_lines = read_metrics(tmp_path / "reference" / "metrics.jsonl")
    (resumed_dir / "metrics.jsonl").write_text(
        (tmp_path / "reference" / "metrics.jsonl").read_text()
    )

    config = load_config("configs/cpu-tiny.yaml", overrides(tmp_path, "resumed"))
    trainer = Trainer(config, resume=True)
    killed = {}

    def kill_one_generator_mid_run():
        while trainer.step < STEPS // 2 + 2:
            time.sleep(0.05)
        killed["at_step"] = trainer.step
        ray.kill(trainer.generators[1], no_restart=False)

    killer = threading.Thread(target=kill_one_generator_mid_run, daemon=True)
    killer.start()
    trainer_pool = {}
    original_close = trainer.close

    def close_and_keep_pool():
        trainer_pool["restarts"] = trainer.pool.restarts
        trainer._await_generators()
        trainer_pool["versions"] = ray.get([g.policy_version.remote() for g in trainer.generators])
        original_close()

    trainer.close = close_and_keep_pool
    summary = trainer.run()
    killer.join(timeout=5)

    assert summary["final_step"] == STEPS
    assert "at_step" in killed and trainer_pool["restarts"] >= 1
    assert trainer_pool["versions"] == [STEPS, STEPS]  # the replacement serves the current policy
    resumed = {r["step"]: r for r in read_metrics(resumed_dir / "metrics.jsonl")}
    reference = {r["step"]: r for r in reference_lines}
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(STEPS // 2 + 1, STEPS + 1):
        for key in DETERMINISTIC:
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-4, abs=1e-6), (
                f"step {step} {key}: resumed {resumed[step][key]} vs {reference[step][key]}"
            )
