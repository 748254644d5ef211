"""The coordinator's bookkeeping after a failed sync, with a recording stand-in for the pool
and the learners (tests/test_sync_peer_loss.py runs the same path with real replicas)."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError, RayTaskError

from cagrpo_ray.sync import WeightSyncError
from cagrpo_ray.sync.coordinator import WeightSyncCoordinator

pytestmark = pytest.mark.unit


class RecordingPool:
    """What the coordinator tells a `GeneratorPool`, and the outcomes its calls return."""

    def __init__(self, num_replicas: int):
        self.lost, self.calls, self.members = set(), [], ()
        self.num_replicas = num_replicas

    def live_replicas(self):
        return [r for r in range(self.num_replicas) if r not in self.lost]

    needs_weights = needs_weights_now = frozenset()  # read for the log only

    def join_weight_sync(self, address, workers_per_replica, replicas):
        self.members = tuple(replicas)
        self.calls.append(("join", address["world_size"], self.members))
        return [("join", r) for r in replicas]

    def receive_weights(self, version):
        return [("receive", r) for r in self.members]

    def loaded(self, version, replicas):
        self.calls.append(("loaded", version, tuple(replicas)))

    def missed_sync(self, replicas):
        self.calls.append(("missed", tuple(replicas)))

    def lose(self, replica):
        self.lost.add(replica)
        self.calls.append(("lose", replica))


class Learners:
    def __init__(self, sends: list[dict]):
        self.sends = sends  # rank 0's result of each send, in order

    def open_weight_sender(self, world_size, backend, timeout_s, bucket_mb):
        return {"host": "127.0.0.1", "port": 29500, "world_size": world_size}  # asdict's keys

    def submit_send_weights(self, version):
        return ["send"]

    def collect(self, refs, what):
        return [self.sends.pop(0)]


def coordinator(pool, sends, outcomes: dict):
    """`outcomes[(kind, replica)]`: a list of what each call's ref gives (an exception is
    raised), consumed in order; anything not listed succeeds."""

    def wait(refs, what):
        (ref,) = refs
        result = outcomes.get(ref, [])
        result = result.pop(0) if result else {"version": None, "num_bytes": 1}
        if isinstance(result, Exception):
            raise result
        return [result]

    return WeightSyncCoordinator(Learners(sends), pool, 1, "gloo", 5.0, 1.0, wait)


def test_a_replica_lost_mid_sync_costs_only_itself():
    pool, outcomes = RecordingPool(3), {}
    sync = coordinator(pool, [{"num_bytes": 1}, {"error": "a worker died"}, {"num_bytes": 1}],
                       outcomes)  # fmt: skip
    sync.build_group()
    sync.sync(1)
    pool.calls.clear()
    # v2: replica 1 dies mid-transfer; the survivors' receives fail as sync errors
    failed = RayTaskError("receive_weights", "", WeightSyncError("bucket 4: mid-transfer"))
    outcomes.update({("receive", 0): [failed], ("receive", 1): [RayActorError()],
                     ("receive", 2): [failed]})  # fmt: skip
    sync.start(2)
    sync.finish()
    # The survivors keep their version, the dead replica is lost: each outcome its own.
    assert pool.calls == [("missed", (0,)), ("lose", 1), ("missed", (2,)), ("loaded", 2, ())]
    pool.calls.clear()
    sync.resync(2)  # the group is rebuilt from the live replicas, without waiting
    assert pool.calls == [("join", 3, (0, 2)), ("loaded", 2, (0, 2))]


def test_a_replica_found_dead_while_the_group_forms_is_left_out():
    pool = RecordingPool(3)
    outcomes = {("join", 1): [RayActorError()]}
    sync = coordinator(pool, [], outcomes)
    sync.build_group()
    assert pool.calls == [("join", 4, (0, 1, 2)), ("lose", 1), ("join", 3, (0, 2))]


def test_a_member_lost_between_syncs_is_left_out_of_the_next():
    pool = RecordingPool(3)
    sync = coordinator(pool, [{"num_bytes": 1}, {"num_bytes": 1}], {})
    sync.build_group()
    sync.sync(1)
    pool.lose(1)  # its chunk came back lost: it died while generating
    pool.calls.clear()
    sync.start(2)
    sync.finish()
    assert pool.calls == [("join", 3, (0, 2)), ("loaded", 2, (0, 2))]
