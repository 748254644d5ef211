"""`GeneratorPool.state()`: the replicas' state in the scheduler's error when nothing can be
dispatched, so that a stuck run says which replica held what."""

from __future__ import annotations

import pytest

from cagrpo_ray.rollout.pool import GeneratorPool

pytestmark = pytest.mark.unit


class Method:
    def remote(self, *args):
        return object()  # a ref that is never waited on here


class Actor:
    ready = Method()
    receive_weights = Method()


def test_the_state_names_each_replicas_version_and_condition():
    pool = GeneratorPool([Actor(), Actor(), Actor()])
    pool.receive_weights(4)  # all three load v4
    pool.loaded(4, [0])  # replica 0 loaded it
    pool.missed_sync([1])  # replica 1's load failed: it serves v0, behind
    pool.lose(2)  # replica 2 died: stale and lost
    state = pool.state()
    assert state.startswith("versions [4, 0, ")  # replica 1 serves its old version
    assert "loading []" in state  # a lost replica's load holds no work for it
    assert "stale [2]" in state and "behind [1]" in state and "lost [2]" in state
    assert "sync group [0, 1, 2]" in state
