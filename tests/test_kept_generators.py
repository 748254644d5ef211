"""Which runs may share generator replicas (`rollout/kept.py`): those whose configs start them
alike, whatever else differs."""

from __future__ import annotations

import pytest

from cagrpo_ray.config import load_config
from cagrpo_ray.rollout.kept import KeptGenerators, replica_key

pytestmark = pytest.mark.unit

CPU_ENV = [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]


def key(*sets, path="/policies/a", env=CPU_ENV, config="configs/cpu-tiny.yaml"):
    return replica_key(load_config(config, list(sets)), path, env)


@pytest.mark.parametrize(
    "sets",
    [
        ["run.steps=3", "run.max_staleness=1", "data.eval_size=8", "eval.samples=1"],
        ["algorithm.policy_loss=grpo", "algorithm.advantage_estimator=rloo", "algorithm.lr=1e-3"],
        ["rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.chunk_prompts=1"],
        ["learner.num_learners=1", "metrics.port=0", "run.name=other"],
    ],
)
def test_what_the_replicas_do_not_hold_may_differ(sets):
    assert key(*sets) == key()


@pytest.mark.parametrize(
    "sets",
    [
        ["rollout.enforce_eager=true"],
        ["rollout.max_model_len=512"],
        ["run.seed=1"],  # each engine's own seed
        ["rollout.weight_update=in_flight"],
        ["rollout.num_cpus_per_generator=1"],  # the bundle
        ["rollout.max_turns=2"],  # the environment the replica hosts
    ],
)
def test_what_the_replicas_are_started_with_may_not(sets):
    assert key(*sets) != key()


def test_another_policy_cores_or_replica_count_is_another_set():
    assert key(path="/policies/b") != key()
    assert key(env=CPU_ENV[::-1]) != key()
    one = [{"VLLM_CPU_OMP_THREADS_BIND": "0-1"}]
    assert key("rollout.num_generators=1", env=one) != key()


def test_the_two_bounds_of_the_end_to_end_test_share_replicas():
    # tests/test_train.py runs configs/cpu-tiny.yaml and configs/async.yaml on one set
    assert key(config="configs/async.yaml") == key()


def test_an_empty_holder_fits_nothing():
    kept = KeptGenerators()
    assert not kept.fits(key()) and kept.actors == []
    kept.close()  # nothing to end
