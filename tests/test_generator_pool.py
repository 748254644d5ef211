"""GeneratorPool: prompt order, balancing across replicas, and a replica that dies mid-run."""

import os
import time

import pytest
import ray

from cagrpo_ray.rollout.pool import GeneratorPool
from cagrpo_ray.types import Completion, SamplingConfig

pytestmark = pytest.mark.integration


@ray.remote(max_restarts=-1, num_cpus=0)
class EchoReplica:
    """Stands in for a generator in this unit of the pool: echoes prompts, can crash once."""

    def __init__(self, name, crash_marker=None, load_s=0.0):
        self.name, self.crash_marker, self.calls = name, crash_marker, 0
        self.load_s = load_s

    def generate(self, prompts, sampling):
        self.calls += 1
        if self.crash_marker and not os.path.exists(self.crash_marker):
            open(self.crash_marker, "w").close()
            os._exit(1)
        return [
            [
                Completion(p, [p[0], i], [-0.5, -0.5], f"{self.name}", "stop", 0)
                for i in range(sampling.n)
            ]
            for p in prompts
        ]

    def count(self):
        return self.calls

    def receive_weights(self, version):
        time.sleep(self.load_s)
        return version

    def ready(self):
        return {"name": self.name}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_results_in_prompt_order_and_spread_over_replicas(local_ray):
    actors = [EchoReplica.remote(f"r{i}") for i in range(2)]
    pool = GeneratorPool(actors, chunk_prompts=3)
    prompts = [[i] for i in range(20)]
    out = pool.generate(prompts, SamplingConfig(n=2, seed=1))
    assert [group[0].token_ids[0] for group in out] == list(range(20))
    assert all(len(group) == 2 for group in out)
    calls = ray.get([a.count.remote() for a in actors])
    assert sum(calls) == 7 and min(calls) >= 1  # 20 prompts in chunks of 3; both replicas used


def test_a_dead_replica_loses_nothing_and_is_resynced_before_serving(local_ray, tmp_path):
    marker = str(tmp_path / "crashed")
    actors = [EchoReplica.remote("ok"), EchoReplica.remote("crashy", marker)]
    pool = GeneratorPool(actors, chunk_prompts=2)
    out = pool.generate([[i] for i in range(10)], SamplingConfig(n=1))
    assert [group[0].token_ids[0] for group in out] == list(range(10))
    assert pool.restarts == 1 and pool.needs_weights == {1}
    assert pool.available_replicas() == [0]  # the restarted replica waits for its weights

    # Alone, the restarted replica is resynced (here: told it has version 0) before it serves.
    alone = GeneratorPool([actors[1]], chunk_prompts=2)
    alone.await_ready()  # Ray has restarted it
    alone.lose(0)
    resynced = []

    def resync():  # as the coordinator does: start the loads, then report them
        resynced.append(alone.needs_weights)
        ray.get(alone.receive_weights(0))
        alone.loaded(0, [0])

    out = alone.generate([[i] for i in range(4)], SamplingConfig(n=1), resync=resync)
    assert [group[0].token_ids[0] for group in out] == list(range(4))
    assert resynced == [frozenset({0})] and alone.needs_weights == frozenset()
    with pytest.raises(RuntimeError, match="a resync is needed"):
        alone.lose(0)
        alone.generate([[0]], SamplingConfig(n=1))


def test_chunks_in_flight_are_tagged_and_busy_time_counted(local_ray):
    actors = [EchoReplica.remote(f"r{i}") for i in range(2)]
    pool = GeneratorPool(actors, chunk_prompts=2)
    pool.submit(0, [[1], [2]], SamplingConfig(n=1), tag="a")
    pool.submit(1, [[3]], SamplingConfig(n=1), tag="b")
    assert len(pool.in_flight()) == 2 and all(pool.owns(ref) for ref in pool.in_flight())
    finished = sorted(pool.drain(), key=lambda f: f.chunk.tag)
    assert [f.chunk.tag for f in finished] == ["a", "b"] and not any(f.lost for f in finished)
    assert [g[0].token_ids[0] for g in finished[0].groups] == [1, 2]
    assert pool.busy_seconds > 0 and not pool.in_flight()
    assert pool.available_replicas() == [0, 1]


def test_work_waits_for_an_idle_replica_that_is_loading_weights(local_ray):
    """After a sync every replica loads at once: the first to finish must not take the whole
    batch while the others are a moment from serving."""
    actors = [EchoReplica.remote("fast"), EchoReplica.remote("slow", load_s=1.0)]
    pool = GeneratorPool(actors, chunk_prompts=2)
    fast, slow = pool.receive_weights(0)
    ray.get(fast)
    assert pool.available_replicas() == []  # the slow replica is idle and still loading
    ray.get(slow)
    assert pool.available_replicas() == [0, 1]

    # A replica with requests in flight loads after them: the others do not wait for it.
    pool.submit(1, [[1]], SamplingConfig(n=1), tag="old")
    fast, slow = pool.receive_weights(0)
    ray.get(fast)
    assert pool.available_replicas() == [0]
    pool.drain()

    # Blocking generation waits for a load instead of giving up on the pool, and uses both.
    pool.receive_weights(0)
    out = pool.generate([[i] for i in range(8)], SamplingConfig(n=1))
    assert [group[0].token_ids[0] for group in out] == list(range(8))
    assert {c.text for group in out for c in group} == {"fast", "slow"}


def test_a_replica_lost_after_its_load_but_before_it_was_reported_still_needs_weights(local_ray):
    """The coordinator reports a sync's loads after the fact (`loaded`). A replica lost in
    between (tests/test_chaos.py kills one mid-generation, after its load of the step's
    weights) holds nothing once Ray restarts it: it must stay in `needs_weights`, or it is
    never resynced, is given work it answers at version 0, and is counted lost twice."""
    actors = [EchoReplica.remote("a"), EchoReplica.remote("b")]
    pool = GeneratorPool(actors, chunk_prompts=2)
    ray.get(pool.receive_weights(3))
    pool.lose(1)  # its chunk failed: it died after its load
    pool.loaded(3, [0, 1])  # the coordinator collects the sync: both receives had succeeded
    assert pool.needs_weights == {1} and pool.restarts == 1
    assert pool.available_replicas() == [0]
    pool.await_ready()  # Ray has restarted it (this one never died: it answers at once)
    assert pool.needs_weights_now == {1}
    ray.get(pool.receive_weights(4))  # the resync brings it back
    pool.loaded(4, [0, 1])
    assert not pool.needs_weights and pool.version(1) == 4 and pool.restarts == 1
