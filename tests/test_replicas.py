"""The replica table (`rollout/replicas.py`): one record per replica, changed only by its
transitions. Random sequences of loads, acknowledgements, failures, losses, restarts and
requests (hypothesis), each checked against the table's invariants and against a reference
written from the transition table of the module docstring; and the orders that went wrong in
the pool's five containers before it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cagrpo_ray.rollout.replicas import Phase, ReplicaStateError, ReplicaTable

pytestmark = pytest.mark.unit

N = 3


@dataclass
class Expected:
    """What a replica should be, kept from the docstring's rules by the test alone."""

    phase: str = "ready"
    version: int = 0
    behind: bool = False
    loading: tuple | None = None  # (version, version before, phase before, behind before)
    prompts: int = 0


def apply(table: ReplicaTable, expected: list[Expected], counts: list[int], op) -> None:
    """One operation on the table and on the reference; a refused transition must be one the
    reference refuses too."""
    name, r, value = op
    e = expected[r]
    if name == "start_load":
        if e.phase == "lost":
            assert table.start_load(r, value) is False
        elif e.phase in ("ready", "restarted"):
            assert table.start_load(r, value) is True
            e.loading = (value, e.version, e.phase, e.behind)
            e.phase, e.version = "loading", value
        else:  # loading: the new load follows the unreported one, and leaves what it left
            assert table.start_load(r, value) is True
            earlier, _, phase, behind = e.loading
            e.loading = (value, earlier, phase, behind)
            e.version = value
    elif name == "load_done":
        loaded = e.loading[0] if e.loading else value
        table.load_done(r, loaded)
        if e.phase == "loading":
            e.phase, e.version, e.behind, e.loading = "ready", loaded, False, None
    elif name == "load_done_stale":  # an acknowledgement of a load that no longer holds
        table.load_done(r, value + 1000)
    elif name == "load_failed":
        table.load_failed(r)
        if e.phase == "loading":
            version, before, phase, behind = e.loading
            e.phase, e.version, e.loading = phase, before, None
            e.behind = behind or phase == "ready"
    elif name == "lose":
        newly = table.lose(r)
        assert newly == (e.phase != "lost")
        if e.phase != "lost":
            awaiting = e.phase == "restarted" or (e.loading and e.loading[2] == "restarted")
            counts[0] += 0 if awaiting else 1
            e.phase, e.loading, e.behind = "lost", None, False
    elif name == "back":
        if e.phase == "lost":
            table.back(r)
            e.phase = "restarted"
        else:
            with pytest.raises(ReplicaStateError):
                table.back(r)
    elif name == "submit":
        if e.phase == "ready":
            table.submitted(r, value)
            e.prompts += value
        else:
            with pytest.raises(ReplicaStateError):
                table.submitted(r, value)
    elif name == "return":
        if e.prompts:
            n = min(value, e.prompts)
            table.returned(r, n)
            e.prompts -= n
        else:
            with pytest.raises(ReplicaStateError):
                table.returned(r, 1)


def check(table: ReplicaTable, expected: list[Expected], counts: list[int], limit: int) -> None:
    phases = {
        "ready": Phase.READY, "loading": Phase.LOADING, "lost": Phase.LOST,
        "restarted": Phase.RESTARTED,
    }  # fmt: skip
    for i, e in enumerate(expected):
        record = table[i]
        assert record.phase is phases[e.phase], (i, record, e)
        assert (record.version, record.behind, record.prompts) == (e.version, e.behind, e.prompts)
        # the invariants the five containers held only by call order
        assert (record.phase is Phase.LOADING) == (record.load is not None)
        assert not (record.behind and record.phase in (Phase.LOST, Phase.RESTARTED))
    assert table.restarts == counts[0]
    lost = {i for i, e in enumerate(expected) if e.phase == "lost"}
    need = {i for i, e in enumerate(expected) if e.phase in ("lost", "restarted") or e.behind}
    assert table.needs_weights == need and table.needs_weights_now == need - lost
    assert table.live() == [i for i in range(N) if i not in lost]
    assert table.loading == any(e.phase == "loading" for e in expected)
    available = table.available(2)
    if any(e.phase == "loading" and e.prompts == 0 for e in expected):
        assert available == []  # the work waits for the idle replica that is loading
    else:
        fits = [
            i for i, e in enumerate(expected)
            if e.phase == "ready" and (limit <= 0 or e.prompts + 2 <= limit)
        ]  # fmt: skip
        assert available == sorted(fits, key=lambda i: (expected[i].prompts, i))


OPERATIONS = st.tuples(
    st.sampled_from(
        [
            "start_load",
            "load_done",
            "load_done_stale",
            "load_failed",
            "lose",
            "back",
            "submit",
            "return",
        ]  # fmt: skip
    ),
    st.integers(0, N - 1),
    st.integers(1, 6),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OPERATIONS, max_size=60), limit=st.sampled_from([0, 3, 8]))
def test_random_sequences_keep_the_records_and_their_invariants(ops, limit):
    table = ReplicaTable(N, max_prompts_in_flight=limit)
    expected, counts = [Expected() for _ in range(N)], [0]
    for op in ops:
        apply(table, expected, counts, op)
        check(table, expected, counts, limit)


def test_a_replica_lost_while_loading_holds_no_work_for_its_load():
    """The order of the chaos-found bug: a replica that died during a sync stayed among the
    loading ones, and an idle loading replica holds all work back."""
    table = ReplicaTable(2)
    for r in (0, 1):
        table.start_load(r, 1)
    table.load_done(0, 1)
    assert table.available() == []  # replica 1 is idle and loading: the work waits for it
    table.lose(1)
    assert table.available() == [0] and not table.loading
    table.load_done(1, 1)  # the coordinator's late acknowledgement changes nothing
    assert table.phase(1) is Phase.LOST and table.needs_weights_now == frozenset()


def test_killed_mid_sync_and_back_within_the_timeout():
    """Replica 1 killed during the sync of v5 and restarted before its peer's receive timed
    out: the peer stays on v4 (behind, serving), replica 1 awaits a resync, counted once
    however many times its death is seen."""
    table = ReplicaTable(2)
    for r in (0, 1):
        table.start_load(r, 4)
        table.load_done(r, 4)
        table.start_load(r, 5)
    table.lose(1)  # its receive failed: the actor died
    table.back(1)  # Ray restarted it
    table.lose(1)  # its chunk came back with initial weights: the same loss
    table.load_failed(0)  # the peer's receive timed out; its model is still v4
    assert (table.version(0), table[0].behind, table.phase(0)) == (4, True, Phase.READY)
    assert table.restarts == 1 and table.needs_weights_now == frozenset({0})
    table.back(1)
    assert table.needs_weights_now == frozenset({0, 1})
    for r in (0, 1):  # the resync
        table.start_load(r, 5)
        table.load_done(r, 5)
    assert table.needs_weights == frozenset() and table.available() == [0, 1]
