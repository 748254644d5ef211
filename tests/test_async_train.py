"""Asynchronous mode end to end on the CPU (2 vLLM generators, 2 DeepSpeed ranks, real Ray).

- max_staleness 0 is the synchronous schedule: an async run reproduces a sync run's per-step
  metrics on the same seeds.
- max_staleness 1 overlaps generation with training (samples one version old are trained on),
  never exceeds the bound, survives a generator crash, and resumes from its checkpoint.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from cagrpo_ray.async_trainer import AsyncTrainer, admissible_groups
from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.trainer import Trainer, make_trainer

pytestmark = pytest.mark.integration

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
    "staleness/mean",
]


def overrides(tmp_path, name, steps, *extra):
    return [
        "model.path=chain_sum",
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        f"run.steps={steps}",
        "data.eval_size=16",
        "eval.samples=2",
        "metrics.port=0",
        "sync.timeout_s=20",
        *extra,
    ]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=3, include_dashboard=False)
    yield
    ray.shutdown()


def test_zero_staleness_reproduces_the_synchronous_run(local_ray, tmp_path):
    steps = 5
    sync = load_config("configs/cpu-tiny.yaml", overrides(tmp_path, "sync", steps))
    asyn = load_config(
        "configs/cpu-tiny.yaml",
        overrides(tmp_path, "async0", steps, "run.mode=async", "run.max_staleness=0"),
    )
    assert type(make_trainer(asyn)) is AsyncTrainer
    Trainer(sync).run()
    AsyncTrainer(asyn).run()
    a = {r["step"]: r for r in read_metrics(tmp_path / "sync" / "metrics.jsonl")}
    b = {r["step"]: r for r in read_metrics(tmp_path / "async0" / "metrics.jsonl")}
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        assert b[step]["staleness/max"] == 0
        assert b[step]["buffer/dropped_stale_groups"] == 0
        for key in DETERMINISTIC:
            assert b[step][key] == a[step][key], (step, key, a[step][key], b[step][key])


def test_bounded_staleness_overlaps_survives_a_crash_and_resumes(local_ray, tmp_path):
    steps = 8
    config = load_config(
        "configs/async.yaml",
        overrides(tmp_path, "async1", steps, "run.checkpoint_every=4"),
    )
    assert config.run.mode == "async" and config.run.max_staleness == 1
    trainer = AsyncTrainer(config)
    killed = {}

    def kill_one_generator_mid_run():
        while trainer.step < 3:
            time.sleep(0.05)
        killed["at_step"] = trainer.step
        ray.kill(trainer.generators[0], no_restart=False)

    killer = threading.Thread(target=kill_one_generator_mid_run, daemon=True)
    killer.start()
    seen = {}
    original_close = trainer.close

    def close_and_keep_state():
        seen["restarts"] = trainer.pool.restarts
        trainer._await_generators()
        seen["versions"] = ray.get([g.policy_version.remote() for g in trainer.generators])
        original_close()

    trainer.close = close_and_keep_state
    summary = trainer.run()
    killer.join(timeout=5)

    assert summary["final_step"] == steps and "eval_after" in summary
    assert "at_step" in killed and seen["restarts"] >= 1
    assert seen["versions"] == [steps, steps]  # the replacement serves the current policy
    records = read_metrics(tmp_path / "async1" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["staleness/max"] <= 1 for r in records)
    # generation overlapped training: most batches were sampled one version back
    assert sum(r["staleness/mean"] > 0 for r in records) >= steps // 2
    assert all(0.0 <= r["generators/idle_fraction"] <= 1.0 for r in records)
    assert all(r["tis/weight_mean"] > 0 for r in records)  # async.yaml turns the IS weight on
    assert (tmp_path / "async1" / "plots" / "entropy.png").exists()

    # Resume: continues from the step-8 checkpoint to step 10.
    more = load_config(
        "configs/async.yaml", overrides(tmp_path, "async1", steps + 2, "run.checkpoint_every=4")
    )
    resumed = AsyncTrainer(more, resume=True).run()
    assert resumed["final_step"] == steps + 2
    records = read_metrics(tmp_path / "async1" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 3))


@pytest.mark.parametrize(
    "gen, train, outstanding, staleness, want",
    [
        (0, 0, 0, 0, 16),  # sync: one batch may be generated at the learner's version
        (0, 0, 16, 0, 0),  # ... and no more until it has been trained
        (0, 1, 0, 0, 0),  # learner training v0 -> v1: data from v0 would be stale
        (0, 1, 0, 1, 16),  # one version of lag allowed: the next batch may be generated
        (0, 1, 10, 1, 6),
        (3, 1, 0, 2, 80),  # replicas ahead of the learner (never happens) may run further
    ],
)
def test_admission_rule(gen, train, outstanding, staleness, want):
    assert admissible_groups(gen, train, outstanding, 16, staleness) == want
