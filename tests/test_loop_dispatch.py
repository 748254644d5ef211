"""The Ray loop's dispatch (`TrainingLoop._pump`) when a weight load settles while it runs.

A weight load can finish between the dispatch's check for replicas that need weights and its
look for available ones (the pool settles finished loads on every look). When that load failed
(a replica killed mid-sync and restarted within the sync's timeout: its peer's receive fails
too, and stays on its old version), the replica left on the old version is available but the
synchronous bound admits nothing at that version, the sync's refs are all resolved, and
nothing is in flight: the loop must resync it, not stop with "nothing in flight".
"""

from __future__ import annotations

import pytest

from cagrpo_ray.config import load_config
from cagrpo_ray.driver.loop import TrainingLoop

pytestmark = pytest.mark.unit


class RacingPool:
    """Two replicas at the learner's version 1 whose loads of it fail while the dispatch
    looks: the first look (`needs_weights_now`) finds nothing, the second
    (`available_replicas`) finds replica 0 back on version 0 and replica 1 lost."""

    num_replicas = 2

    def __init__(self):
        self.versions = [1, 1]
        self.behind: set[int] = set()
        self.lost: set[int] = set()
        self.settles_failed_loads_next = False
        self.submitted: list[tuple[int, int]] = []  # (replica, version)
        self.loading = False

    @property
    def needs_weights_now(self) -> frozenset[int]:
        return frozenset(self.behind)

    def available_replicas(self, chunk: int = 1) -> list[int]:
        if self.settles_failed_loads_next:
            self.settles_failed_loads_next = False
            self.versions[0], self.behind, self.lost = 0, {0}, {1}
        return [r for r in range(self.num_replicas) if r not in self.lost]

    def version(self, replica: int) -> int:
        return self.versions[replica]

    def submit(self, replica, prompts, sampling, tag) -> None:
        self.submitted.append((replica, self.versions[replica]))

    def in_flight(self) -> list:
        return list(self.submitted)

    def drain(self) -> list:
        return []

    def state(self) -> str:
        return f"versions {self.versions}, behind {sorted(self.behind)}, lost {self.lost}"


class Coordinator:
    """Resyncs the live replicas to the version asked for."""

    def __init__(self, pool: RacingPool):
        self.pool, self.resyncs = pool, []

    def finish(self) -> None:
        pass

    def pending(self) -> list:
        return []

    def resync(self, version: int) -> None:
        self.resyncs.append(version)
        for replica in range(self.pool.num_replicas):
            if replica not in self.pool.lost:
                self.pool.versions[replica] = version
        self.pool.behind.clear()


def loop_at_step_1(bound: int) -> tuple[TrainingLoop, RacingPool, Coordinator]:
    config = load_config("configs/cpu-tiny.yaml", [f"run.max_staleness={bound}"])
    pool = RacingPool()
    coordinator = Coordinator(pool)
    loop = TrainingLoop(config, None, range(64), pool, None, None, coordinator, None)
    loop.schedule.step = 1  # one step trained; its groups all taken
    loop.schedule.next_group_id = config.rollout.prompts_per_step
    loop._submit = lambda replica, start: pool.submit(replica, None, None, start.chunk)
    return loop, pool, coordinator


def test_a_load_that_failed_during_the_dispatch_is_resynced_and_work_goes_out():
    loop, pool, coordinator = loop_at_step_1(bound=0)
    pool.settles_failed_loads_next = True
    refs = loop._dispatch_then_waitable(None)
    assert coordinator.resyncs == [1]  # replica 0 brought back to the learner's version
    assert refs and pool.submitted and all(v == 1 for _, v in pool.submitted)
    assert {r for r, _ in pool.submitted} == {0}  # nothing to the lost replica


def test_with_nothing_to_resync_and_nothing_admitted_the_loop_still_says_so():
    loop, pool, coordinator = loop_at_step_1(bound=0)
    pool.versions = [0, 0]  # both behind the bound, and (wrongly) not marked as needing weights
    with pytest.raises(RuntimeError, match="nothing in flight.*versions \\[0, 0\\]"):
        loop._pump()
    assert coordinator.resyncs == []
