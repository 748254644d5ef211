"""The bounded-staleness schedule (cagrpo_ray/schedule.py) without Ray: scripted event orders,
and random ones (hypothesis) played against a model of the roles around it.

The model keeps what the real roles guarantee and nothing more: a replica samples each chunk
with the version it held when the chunk was sent; after a learner step every replica loads the
new weights once the chunks it holds have finished, and gets no chunk while loading; the next
step cannot end before that load has ended everywhere (the sync coordinator finishes the
previous broadcast first); the reward pool scores chunks in the order they reached it; a dead
replica's chunks come back lost, and the replicas are resynced (what is in flight finishes
first) only while the learner is idle. Checkpoints are taken between steps, and a resume drops
everything in flight.

Invariants, for s = 0, 1 and 3, across lost chunks, requeues and resumes: no trained sample is
staler than s; batches follow each other in start order (group ids increase across the run);
group g holds prompt g mod N; no group is dropped; every group started is trained exactly once,
or filtered by dynamic sampling, or still outstanding when the run ends (and then started after
every trained one). Without dynamic sampling the batches are those of the strictly sequential
loop, whatever the bound: batch k holds groups k * P to (k + 1) * P - 1.

Batches wait for a slow group rather than let later ones overtake it: before they did, with
s >= 1 the slow group could exceed the bound and be dropped, its prompt never trained (about a
quarter of the random orders did; `test_a_slow_group_is_not_overtaken` is such an order).
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cagrpo_ray.rollout.buffer import group_record_batch
from cagrpo_ray.rollout.replicas import Phase, ReplicaTable
from cagrpo_ray.rollout.requeue import PromptChunk
from cagrpo_ray.schedule import (
    DynamicSamplingError,
    Schedule,
    ScheduleSettings,
    step_seed,
)
from cagrpo_ray.types import Completion

pytestmark = pytest.mark.unit

GROUP = 2  # responses per group


def settings_for(s=0, P=4, chunk=2, steps=6, prompts=10, dynamic=False, max_gen=3):
    return ScheduleSettings(
        prompts_per_step=P, chunk_prompts=chunk, max_staleness=s, steps=steps,
        num_prompts=prompts, run_seed=7, groups_assessed_limit=max_gen * P if dynamic else None,
    )  # fmt: skip


def record(group_id: int, prompt: int, version: int):
    """A scored group of GROUP one-token responses sampled by `version`."""
    completions = [Completion([prompt], [1], [-0.5], "x", "stop", version) for _ in range(GROUP)]
    return group_record_batch(f"u{prompt}", group_id, completions, [0.0, 1.0],
                              [False, True], [-1.0, 1.0])  # fmt: skip


def scored(schedule: Schedule, chunk: PromptChunk, version: int) -> None:
    groups = [record(g, i, version) for i, g in zip(chunk.indices, chunk.group_ids, strict=True)]
    schedule.chunk_scored(chunk, groups)


def batch_groups(batch) -> list[int]:
    return batch.table.column("group_id").to_pylist()[::GROUP]


def test_the_schedule_imports_no_ray_vllm_or_deepspeed():
    code = (
        "import sys, cagrpo_ray.schedule; "
        "print(sorted(m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------ scripted orders


def test_s0_is_the_sequential_loop():
    """s = 0, two replicas: each step's prompts are generated at the learner's version, in
    order, and nothing of the next step starts before the step has trained."""
    sch = Schedule(settings_for(s=0, P=4, chunk=2, steps=3, prompts=5))
    for step in range(3):
        starts = []
        while sch.prompts_wanted() > 0 and (start := sch.start_chunk(2, step)) is not None:
            starts.append(start)
        assert [s.chunk.group_ids for s in starts] == [
            (4 * step, 4 * step + 1), (4 * step + 2, 4 * step + 3)
        ]  # fmt: skip
        assert [s.seed for s in starts] == [step_seed(7, step)] * 2
        assert [s.place for s in starts] == [0, 2]
        assert sch.start_chunk(2, step) is None  # the bound: one batch ahead at most
        for start in reversed(starts):  # the second replica finished first
            assert sch.take_batch() is None
            scored(sch, start.chunk, step)
        batch = sch.take_batch()
        assert batch_groups(batch) == list(range(4 * step, 4 * step + 4))
        prompts = batch.table.column("prompt_uid").to_pylist()[::GROUP]
        assert prompts == [f"u{g % 5}" for g in range(4 * step, 4 * step + 4)]  # epochs wrap
        sch.step_started()
        assert sch.start_chunk(2, step) is None  # training v -> v+1: data of v would be stale
        sch.step_trained()
    assert sch.prompts_wanted() <= 0  # nothing past the last step
    assert sch.cursor == 2  # 12 prompts of a 5-prompt source: two epochs and 2


def test_a_lost_chunk_starts_again_with_its_own_ids_and_seed():
    sch = Schedule(settings_for(s=1, P=4, chunk=2, steps=4))
    starts = [sch.start_chunk(2, 0) for _ in range(3)]
    sch.chunk_lost(starts[1].chunk)  # its replica died
    again = sch.start_chunk(2, 0)
    assert again == starts[1]  # same prompts, group ids and seed
    new = sch.start_chunk(2, 0)  # then new prompts, after the ones already started
    assert new.chunk == PromptChunk((6, 7), (6, 7))
    # a requeued chunk split by a smaller request keeps its group ids, so its seeds' places
    sch.chunk_lost(new.chunk)
    head, tail = sch.start_chunk(1, 0), sch.start_chunk(1, 0)
    assert (head.chunk, tail.chunk) == (PromptChunk((6,), (6,)), PromptChunk((7,), (7,)))
    assert (head.place, tail.place) == (2, 3) and head.seed == tail.seed == step_seed(7, 1)


def test_a_checkpoint_requeues_what_was_in_flight_and_keeps_the_buffer(tmp_path):
    sch = Schedule(settings_for(s=1, P=4, chunk=2, steps=5))
    a, b, c = (sch.start_chunk(2, 0) for _ in range(3))
    scored(sch, b.chunk, 0)
    sch.chunk_lost(c.chunk)
    sch.save(tmp_path, {"kappa_controller": None})
    resumed = Schedule(settings_for(s=1, P=4, chunk=2, steps=5))
    state = resumed.load(tmp_path)
    assert state["kappa_controller"] is None and "policy_version" not in state
    assert resumed.state() == sch.state()
    assert resumed.buffered == 2 and resumed.outstanding() == 2
    # in flight at the checkpoint (a), then lost (c): started again first, in group-id order
    assert resumed.start_chunk(2, 0).chunk == a.chunk
    assert resumed.start_chunk(2, 0).chunk == c.chunk
    assert resumed.start_chunk(2, 0).chunk == PromptChunk((6, 7), (6, 7))
    assert resumed.start_chunk(2, 0) is None  # 8 outstanding = (0 + 1 + 1 - 0) * 4


def test_stale_groups_are_dropped_and_counted():
    sch = Schedule(settings_for(s=1, P=2, chunk=2, steps=9))
    old = sch.start_chunk(2, 0)
    for _ in range(2):  # the learner moved on (a group requeued long ago, a resumed buffer)
        sch.step_trained()
    scored(sch, old.chunk, 0)
    assert sch.take_batch() is None and sch.dropped_stale == 2 and sch.buffered == 0


def test_dynamic_sampling_stops_at_its_bound():
    sch = Schedule(settings_for(s=0, P=2, chunk=2, steps=9, dynamic=True, max_gen=2))
    for _ in range(2):
        start = sch.start_chunk(2, 0)
        sch.chunk_scored(start.chunk, [None, None])  # no group had a signal
        if sch.filtered_groups < 4:
            assert sch.take_batch() is None
    assert sch.filtered_groups == 4
    with pytest.raises(DynamicSamplingError, match="max_gen_batches is 2"):
        sch.take_batch()


def test_resync_only_with_the_learner_idle():
    sch = Schedule(settings_for())
    assert sch.resync_due(True) and not sch.resync_due(False)
    sch.step_started()
    assert not sch.resync_due(True)


def test_a_chunk_not_in_flight_is_refused():
    sch = Schedule(settings_for())
    with pytest.raises(KeyError, match="not in flight"):
        sch.chunk_lost(PromptChunk((0,), (0,)))


def test_a_slow_group_is_not_overtaken():
    """s = 1, replicas X and Y: X's chunk A is slow, Y's chunk B (started after it) is scored
    first. The first batch waits for A: taking B first would let C overtake A as well, and A,
    sampled by version 0, would reach a learner at version 2 and be dropped."""
    sch = Schedule(settings_for(s=1, P=2, chunk=2, steps=5))
    a = sch.start_chunk(2, 0)  # on X
    b = sch.start_chunk(2, 0)  # on Y
    scored(sch, b.chunk, 0)
    assert sch.take_batch() is None  # groups 0 and 1 (A) first
    assert sch.start_chunk(2, 0) is None  # and bound (1) holds the rest back
    scored(sch, a.chunk, 0)
    assert batch_groups(sch.take_batch()) == [0, 1]
    sch.step_started()
    assert sch.start_chunk(2, 0) is None  # version 0 data is for batches 0 and 1 only
    sch.step_trained()
    c = sch.start_chunk(2, 1)  # on Y, loaded version 1
    assert batch_groups(sch.take_batch()) == [2, 3]
    sch.step_started()
    sch.step_trained()
    scored(sch, c.chunk, 1)
    assert batch_groups(sch.take_batch()) == [4, 5]  # sampled by 1, trained by 2: within s
    assert sch.dropped_stale == 0


def test_filtered_groups_are_passed_over_in_start_order():
    """Dynamic sampling: a batch is the first P kept groups in start order, taken once every
    group before its last is scored; the filtered ones between count toward it."""
    sch = Schedule(settings_for(s=1, P=2, chunk=2, steps=5, dynamic=True))
    a, b = sch.start_chunk(2, 0), sch.start_chunk(2, 0)
    sch.chunk_scored(b.chunk, [record(2, 2, 0), record(3, 3, 0)])
    assert sch.take_batch() is None  # groups 0 and 1 are not scored yet
    sch.chunk_scored(a.chunk, [None, record(1, 1, 0)])  # group 0 had no signal
    batch = sch.take_batch()
    assert batch_groups(batch) == [1, 2] and batch.scored_groups == 3
    sch.step_started()
    sch.step_trained()
    c = sch.start_chunk(2, 1)
    assert sch.take_batch() is None  # group 3 waits for 4 and 5
    sch.chunk_scored(c.chunk, [None, record(5, 5, 1)])
    batch = sch.take_batch()
    assert batch_groups(batch) == [3, 5] and batch.scored_groups == 3
    assert sch.filtered_groups == 2 and sch.dropped_stale == 0


# ------------------------------------------------------------------------- random orders


def synced_table(replicas: int, version: int) -> ReplicaTable:
    """The replicas as a run starts them: each loaded with the learner's `version`."""
    table = ReplicaTable(replicas)
    for replica in range(replicas):
        table.start_load(replica, version)
        table.load_done(replica, version)
    return table


class Roles:
    """The generator pool, reward pool, learner and sync around a `Schedule` (see the module
    docstring), stepped by one random choice at a time. The replicas' state is the pool's own
    `ReplicaTable`; the chunks each replica holds are listed here."""

    def __init__(self, config: ScheduleSettings, replicas: int, rng: random.Random):
        self.config, self.rng = config, rng
        self.schedule = Schedule(config)
        self.table = synced_table(replicas, 0)
        self.chunks: list[list] = [[] for _ in range(replicas)]  # (ChunkStart, version)
        self.scoring: list = []  # FIFO of (chunk, version)
        self.training = None  # the batch the learner trains on
        self.batches: list[tuple[int, list[int], list[int], list[str]]] = []
        self.resumes = self.losses = 0
        self.dropped_before = 0  # groups dropped by the schedules before the last resume
        self.filtered: list[int] = []  # groups dynamic sampling filtered (a third of them)
        self.dispatch()

    # the loop: what TrainingLoop._dispatch and train_step do between two events
    def dispatch(self) -> None:
        """Start chunks, take a batch if the learner is idle, and start chunks again (a batch
        taken, or stale groups dropped, changes what may start)."""
        self.start_chunks()
        sch = self.schedule
        if self.training is None and sch.step < self.config.steps:
            batch = sch.take_batch()
            if batch is not None:
                table = batch.table
                versions = table.column("policy_version").to_pylist()
                self.batches.append((sch.step, batch_groups(batch), versions,
                                     table.column("prompt_uid").to_pylist()[::GROUP]))  # fmt: skip
                self.training = batch
                sch.step_started()
            self.start_chunks()

    def start_chunks(self) -> None:
        sch, table = self.schedule, self.table
        if sch.resync_due(bool(table.needs_weights_now)):
            self.resync()
        while (count := sch.prompts_wanted()) > 0:
            ready = table.available(count)
            if not ready:
                break
            start = sch.start_chunk(count, table.version(ready[0]))
            if start is None:
                break
            table.submitted(ready[0], len(start.chunk.indices))
            self.chunks[ready[0]].append((start, table.version(ready[0])))

    def resync(self) -> None:
        """TrainingLoop.resync: what is generating finishes first, and the broadcast under way
        (`coordinator.finish`); then every live replica loads the learner's version."""
        for replica in range(len(self.table)):
            while self.chunks[replica]:
                self.finish_generation(replica)
            if (load := self.table[replica].load) is not None:
                self.table.load_done(replica, load.version)
        for replica in self.table.live():
            self.table.start_load(replica, self.schedule.step)
            self.table.load_done(replica, self.schedule.step)

    def finish_generation(self, replica: int) -> None:
        chunks = self.chunks[replica]
        start, version = chunks.pop(self.rng.randrange(len(chunks)))
        self.table.returned(replica, len(start.chunk.indices))
        if self.table.phase(replica) in (Phase.LOST, Phase.RESTARTED):  # died on the way
            self.schedule.chunk_lost(start.chunk)
        else:
            self.scoring.append((start.chunk, version))

    # the events
    def events(self) -> list:
        """(weight, event) for each event that can happen now; losses and resumes rarer."""
        events, table = [], self.table
        for replica in range(len(table)):
            phase = table.phase(replica)
            if self.chunks[replica]:
                events.append((1.0, lambda r=replica: self.finish_generation(r)))
            if phase is Phase.LOADING and not self.chunks[replica]:
                load = table[replica].load
                events.append((1.0, lambda r=replica, v=load.version: table.load_done(r, v)))
            if self.chunks[replica] and phase in (Phase.READY, Phase.LOADING):
                events.append((0.1, lambda r=replica: self.kill(r)))
            if phase is Phase.LOST:
                events.append((0.5, lambda r=replica: table.back(r)))  # Ray restarted it
        if self.scoring:
            events.append((1.0, self.score_next))
        if self.training is not None and not table.loading:
            events.append((1.0, self.step_ends))
        if self.training is None and self.schedule.step > 0:
            events.append((0.1, self.checkpoint_and_resume))
        return events

    def kill(self, replica: int) -> None:
        assert self.table.lose(replica)
        self.losses += 1

    def score_next(self) -> None:
        chunk, version = self.scoring.pop(0)
        if self.config.groups_assessed_limit is None:  # no dynamic sampling
            scored(self.schedule, chunk, version)
            return
        groups = []
        for index, group_id in zip(chunk.indices, chunk.group_ids, strict=True):
            keep = self.rng.random() < 2 / 3
            groups.append(record(group_id, index, version) if keep else None)
            self.filtered += [] if keep else [group_id]
        self.schedule.chunk_scored(chunk, groups)

    def step_ends(self) -> None:
        self.training = None
        self.schedule.step_trained()
        if not self.schedule.resync_due(bool(self.table.needs_weights_now)):
            for replica in range(len(self.table)):  # the broadcast of the new version starts
                self.table.start_load(replica, self.schedule.step)  # not a lost one

    def checkpoint_and_resume(self) -> None:
        state, table = self.schedule.state(), self.schedule.buffer.to_table()
        self.dropped_before += self.schedule.dropped_stale
        self.schedule = Schedule(self.config)
        self.schedule.restore(state, table)
        self.table = synced_table(len(self.table), self.schedule.step)
        self.chunks = [[] for _ in self.chunks]
        self.scoring = []
        self.resumes += 1

    def run(self, max_events: int = 5000) -> None:
        for _ in range(max_events):
            if self.schedule.step >= self.config.steps:
                return
            events = self.events()
            assert events, "nothing can happen and the run has not ended"
            weights, choices = zip(*events, strict=True)
            self.rng.choices(choices, weights)[0]()
            self.dispatch()
        raise AssertionError("the run did not end")


def check_invariants(roles: Roles) -> None:
    config = roles.config
    P, s, N = config.prompts_per_step, config.max_staleness, config.num_prompts
    assert [step for step, *_ in roles.batches] == list(range(config.steps))
    trained = []
    for step, groups, versions, prompts in roles.batches:
        assert all(step - v <= s for v in versions), (step, versions)  # within the bound
        assert len(groups) == P
        assert prompts == [f"u{g % N}" for g in groups]  # group g holds prompt g mod N
        trained += groups
    # start order across the whole run, so none twice
    assert trained == sorted(set(trained)), trained
    assert roles.dropped_before + roles.schedule.dropped_stale == 0  # none dropped
    filtered = set(roles.filtered)
    assert len(filtered) == len(roles.filtered) and not filtered & set(trained)
    # every group started is trained once or filtered, but for those after the last trained
    # one (still outstanding: buffered, in flight or requeued when the run ended)
    last = trained[-1]
    assert set(trained) | {g for g in filtered if g < last} == set(range(last + 1))
    # without dynamic sampling: the strictly sequential loop's batches, whatever s
    if config.groups_assessed_limit is None:
        assert [groups for _, groups, _, _ in roles.batches] == [
            list(range(k * P, (k + 1) * P)) for k in range(config.steps)
        ]
        assert roles.schedule.next_group_id == config.steps * P  # nothing started in vain


@pytest.mark.parametrize("staleness", [0, 1, 3])
@settings(max_examples=60, deadline=None)
@given(
    rng=st.randoms(use_true_random=False),
    replicas=st.integers(1, 3),
    chunk=st.integers(1, 5),
    prompts_per_step=st.integers(1, 6),
    dynamic=st.booleans(),
)
def test_random_event_orders_keep_the_invariants(staleness, rng, replicas, chunk,
                                                 prompts_per_step, dynamic):  # fmt: skip
    config = settings_for(s=staleness, P=prompts_per_step, chunk=chunk, steps=6, prompts=7,
                          dynamic=dynamic, max_gen=1000)  # fmt: skip
    roles = Roles(config, replicas, rng)
    roles.run()
    check_invariants(roles)


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_random_orders_lose_chunks_and_resume(dynamic):
    """The model does exercise losses and resumes (with a fixed seed), not only clean runs."""
    config = settings_for(s=1, P=4, chunk=2, steps=12, prompts=9, dynamic=dynamic, max_gen=1000)
    roles = Roles(config, 2, random.Random(3))
    roles.run()
    check_invariants(roles)
    assert roles.losses > 0 and roles.resumes > 0
    assert len(roles.filtered) > 0 if dynamic else not roles.filtered
