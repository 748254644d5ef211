"""The bounded-staleness schedule as a plain state machine: events in, decisions out, no Ray.

`Schedule` decides *what* is generated and trained and *when*; the Ray loop that feeds it
(`cagrpo_ray/driver/loop.py`) decides nothing of the sort: it reports what happened and carries
out what the schedule answers. Versions: the learner's version is `step` (steps trained), a
generator replica's is what the generator pool reports it samples its next request with.

Events the loop reports, and what the schedule answers:

    prompts_wanted()              -> how many prompts a chunk started now holds (<= 0: none)
    start_chunk(count, g)         -> a `ChunkStart` (prompt indices, group ids, seed), or None
                                     when bound (1) leaves no room at generator version g
    chunk_lost(chunk)             -> its groups wait in the requeue under their group ids
    chunk_scored(chunk, groups)   -> kept groups enter the buffer; filtered ones are counted
    take_batch()                  -> a `Batch`: the next P groups in start order, or None
                                     (keep pumping); stale groups are dropped first; raises
                                     `DynamicSamplingError` past dynamic sampling's bound
    step_started(), step_trained()   the learner trains version `step` -> `step + 1`
    resync_due(need_weights)      -> resync the replicas now (only with the learner idle,
                                     whose weights are then exactly `step`)
    state(), restore(state, table)   the checkpoint (`save(dir)`, `load(dir)` on disk)

Bounded staleness. A sample's staleness is the learner version that trains on it minus the
version that sampled it. With P prompts per step and bound s, a chunk is only *started* when

    outstanding + chunk <= (g + s + 1 - t) * P                                        (1)

where g is the version the replica will sample with, t the version that will train on the
next batch taken from the buffer (`step`, plus one while a step is running), and
`outstanding` counts groups buffered or in flight (generating or being scored). So data that
would be too stale is never generated, and s = 0 is the synchronous schedule.

Batches in start order. Batch t holds the P kept groups that follow batch t - 1 in group-id
order, and is taken only once every group before its last is resolved (scored and kept,
filtered by dynamic sampling, or dropped): a fast replica's groups wait for a slow one's
started before them, never overtake it. With (1) this is a guarantee. When a chunk starts at
version g, with t' batches taken, the kept groups up to its last are at most the t' * P taken
and the outstanding ones and the chunk's, which (1) bounds by (g + s + 1) * P; so its groups
land in batches t <= g + s, and none is ever staler than s. A lost chunk, started again under
its ids at a version no older, keeps its place. Groups older than the bound are still dropped
when a batch is taken (`min_version = step - s`) and counted (`dropped_stale`), as a safety
net (a checkpoint resumed with a smaller bound, say); otherwise every group started is trained
exactly once or filtered (tests/test_schedule.py checks it on random event orders).

Prompts and groups. Every new group takes the next prompt of the data cursor (which starts
the source again at its end: a new epoch in the same order) and the next group id, so group g
holds prompt g mod N. A chunk lost on the way (its replica died, or it was in flight at a
checkpoint) is started again before any new prompt, under its own group ids (`Requeue`), so
with its own seeds: a seed is fixed by the group's place (step = g // P, index in the step).
A batch is the next groups in start order, so the learner's batches do not depend on which
replica finished first: a run trains the batches of the sequential loop, with any s (and with
dynamic sampling, which starts more groups than a step needs, the first P kept ones). What may
differ with s >= 1 is the version that sampled each group.

Storage. Scored groups are kept as Arrow record batches in a `RolloutBuffer`, whose rows carry
each response's policy version; the schedule reads a group's id and oldest version from them,
so there is one store of what is buffered, and it is what a checkpoint writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cagrpo_ray.errors import StoppedWithCheckpoint
from cagrpo_ray.rollout.buffer import RolloutBuffer
from cagrpo_ray.rollout.requeue import PromptChunk, Requeue

STATE_FILE = "trainer_state.json"  # a checkpoint's schedule state (and the loop's extras)
BUFFER_FILE = "buffer.parquet"  # a checkpoint's buffered groups


class DynamicSamplingError(StoppedWithCheckpoint, RuntimeError):
    """Dynamic sampling found too few groups with a signal within its bound."""


def admissible_groups(
    gen_version: int,
    train_version: int,
    outstanding: int,
    prompts_per_step: int,
    max_staleness: int,
) -> int:
    """How many more prompt groups may be started now under bound (1) of the module docstring."""
    budget = (gen_version + max_staleness + 1 - train_version) * prompts_per_step
    return max(0, budget - outstanding)


def step_seed(run_seed: int, step: int) -> int:
    """The sampling seed of the prompts of learner step `step` (each chunk derives its own from
    it and its place in the step: `rollout.pool.chunk_sampling`)."""
    return run_seed * 1_000_003 + step


@dataclass(frozen=True)
class ScheduleSettings:
    """What the schedule needs of the config (`from_config`)."""

    prompts_per_step: int  # P
    chunk_prompts: int  # prompts per chunk sent to a replica, at most
    max_staleness: int  # s
    steps: int  # learner steps of the run: nothing is generated past the last
    num_prompts: int  # N, the training source's length
    run_seed: int
    # with a group filter (dynamic sampling), the most groups scored toward one batch before
    # the run stops (`Recipe.groups_assessed_limit`); None without one
    groups_assessed_limit: int | None

    @classmethod
    def from_config(
        cls, config, num_prompts: int, groups_assessed_limit: int | None
    ) -> ScheduleSettings:
        r = config.rollout
        return cls(
            prompts_per_step=r.prompts_per_step,
            chunk_prompts=r.chunk_prompts,
            max_staleness=config.run.max_staleness,
            steps=config.run.steps,
            num_prompts=num_prompts,
            run_seed=config.run.seed,
            groups_assessed_limit=groups_assessed_limit,
        )


@dataclass(frozen=True)
class ChunkStart:
    """Decision: generate `chunk` with the sampling seed of step `seed_step`'s prompts, offset
    by the chunk's place `place` in that step (`chunk_sampling(base, place)`)."""

    chunk: PromptChunk
    seed: int  # step_seed(run_seed, seed_step)
    place: int  # index of the chunk's first group in its step


@dataclass(frozen=True)
class Batch:
    """Decision: train on `table` (P whole groups, rows in group-id order)."""

    table: pa.Table
    scored_groups: int  # groups scored toward this batch (dynamic sampling's count)


class Schedule:
    """The bounded-staleness schedule of one run (see the module docstring)."""

    def __init__(self, settings: ScheduleSettings):
        self.settings = settings
        self.step = 0  # learner version: steps trained
        self.training = False  # a learner step is running (step -> step + 1)
        self.cursor = 0  # index of the next new training prompt
        self.next_group_id = 0
        self.requeue = Requeue()  # lost chunks, started again before new prompts
        self.buffer = RolloutBuffer()
        self._in_flight: dict[int, PromptChunk] = {}  # first group id -> chunk (not yet scored)
        self._filtered_ids: set[int] = set()  # filtered groups not yet passed by a batch
        self.filtered_groups = 0  # groups without signal, dropped by dynamic sampling

    # ------------------------------------------------------------------------- views

    @property
    def train_version(self) -> int:
        """The learner version that will train on the next batch taken."""
        return self.step + (1 if self.training else 0)

    @property
    def min_version(self) -> int:
        """The oldest policy version the next batch may hold."""
        return self.step - self.settings.max_staleness

    @property
    def dropped_stale(self) -> int:
        return self.buffer.dropped_stale

    @property
    def buffered(self) -> int:
        return len(self.buffer)

    def in_flight(self) -> list[PromptChunk]:
        """Chunks started and not yet scored (generating, or being scored), in start order."""
        return [self._in_flight[k] for k in sorted(self._in_flight)]

    def first_unresolved(self) -> int:
        """The smallest group id neither scored nor dropped: in flight, requeued or not yet
        started (`next_group_id`). Every group before it is trained, buffered or filtered."""
        waiting = [chunk.group_ids[0] for chunk in self._in_flight.values()]
        waiting += [group_ids[0] for _, group_ids in self.requeue.state([])]
        return min([self.next_group_id, *waiting])

    def outstanding(self) -> int:
        """Groups not yet taken by the learner: buffered, being scored, being generated."""
        in_flight = sum(len(chunk.indices) for chunk in self._in_flight.values())
        return len(self.buffer) + in_flight

    # ---------------------------------------------------------------- generation

    def prompts_wanted(self) -> int:
        """The size of a chunk started now: at most `chunk_prompts`, and nothing past the run's
        last step (that would be generated and never trained); <= 0 when none is wanted."""
        s = self.settings
        needed = (s.steps - self.train_version) * s.prompts_per_step - self.outstanding()
        return min(s.chunk_prompts, needed)

    def start_chunk(self, count: int, gen_version: int) -> ChunkStart | None:
        """Start up to `count` groups on a replica that samples with `gen_version`, as far as
        bound (1) admits: a lost chunk first, else the next prompts of the cursor."""
        s = self.settings
        room = admissible_groups(
            gen_version, self.train_version, self.outstanding(), s.prompts_per_step,
            s.max_staleness,
        )  # fmt: skip
        count = min(count, room)
        if count <= 0:
            return None
        if self.requeue:
            chunk = self.requeue.take(count)
        else:
            indices = tuple(self._next_index() for _ in range(count))
            group_ids = tuple(range(self.next_group_id, self.next_group_id + count))
            self.next_group_id += count
            chunk = PromptChunk(indices, group_ids)
        self._in_flight[chunk.group_ids[0]] = chunk
        # Seeds fixed by each group's place (step, index in the step), not by timing.
        seed_step, place = divmod(chunk.group_ids[0], s.prompts_per_step)
        return ChunkStart(chunk, step_seed(s.run_seed, seed_step), place)

    def _next_index(self) -> int:
        if self.cursor >= self.settings.num_prompts:
            self.cursor = 0  # a new epoch over the same prompts, in the same order
        index = self.cursor
        self.cursor += 1
        return index

    def chunk_lost(self, chunk: PromptChunk) -> None:
        """`chunk`'s replica died (or answered with old weights): start it again later."""
        self._finish(chunk)
        self.requeue.push(chunk)

    def chunk_scored(self, chunk: PromptChunk, groups: list[pa.RecordBatch | None]) -> None:
        """`chunk`'s groups were scored: one record batch per group in chunk order
        (`group_record_batch`), None for a group that dynamic sampling filtered out."""
        self._finish(chunk)
        if len(groups) != len(chunk.group_ids):
            raise ValueError(f"chunk {chunk.group_ids}: {len(groups)} scored groups")
        for group_id, group in zip(chunk.group_ids, groups, strict=True):
            if group is None:
                self.filtered_groups += 1
                self._filtered_ids.add(group_id)
                continue
            self.buffer.add(group)

    def _finish(self, chunk: PromptChunk) -> None:
        if self._in_flight.get(chunk.group_ids[0]) != chunk:
            raise KeyError(f"chunk of groups {chunk.group_ids} is not in flight")
        del self._in_flight[chunk.group_ids[0]]

    # ------------------------------------------------------------------ training

    def take_batch(self) -> Batch | None:
        """The next batch: the P buffered groups of smallest group id, once every group before
        the last of them is resolved (see "Batches in start order"); else None.

        Raises `DynamicSamplingError` rather than wait forever, when dynamic sampling has
        resolved `max_gen_batches` batches' worth of groups toward this step without enough
        groups with a signal."""
        P = self.settings.prompts_per_step
        self.buffer.drop_stale(self.min_version)
        frontier = self.first_unresolved()
        ready = sorted(g for g in self.buffer.group_ids() if g < frontier)
        if len(ready) < P:
            self._check_dynamic_sampling(len(ready), frontier)
            return None
        ids = ready[:P]
        # the groups this batch passes: its own and the filtered ones between them
        passed = {g for g in self._filtered_ids if g < ids[-1]}
        self._filtered_ids -= passed
        return Batch(self.buffer.take_ids(ids), P + len(passed))

    def _check_dynamic_sampling(self, kept: int, frontier: int) -> None:
        """Stop, rather than generate forever, when too few groups carry a signal: `kept` of
        the groups resolved before `frontier` (the next batch's candidates) had one."""
        limit, P = self.settings.groups_assessed_limit, self.settings.prompts_per_step
        scored = kept + sum(g < frontier for g in self._filtered_ids)
        if limit is not None and scored >= limit:
            raise DynamicSamplingError(
                f"dynamic sampling: {scored} groups were scored for learner "
                f"step {self.step + 1} and only {kept} of the {P} needed had "
                f"rewards that differ (algorithm.max_gen_batches is {limit // P}); the "
                "task gives (nearly) every group equal rewards: make it harder or easier, or "
                "turn algorithm.dynamic_sampling off"
            )

    def step_started(self) -> None:
        """The learner began training on the batch taken last."""
        self.training = True

    def step_trained(self) -> None:
        """The learner step ended: the learner's version is `step + 1`."""
        self.training = False
        self.step += 1

    def resync_due(self, replicas_need_weights: bool) -> bool:
        """Resync now: some replica needs the weights and the learner is idle (so its weights
        are version `step`)."""
        return replicas_need_weights and not self.training

    # --------------------------------------------------------------- checkpoints

    def state(self) -> dict:
        """What a checkpoint needs to continue (JSON), besides the buffered groups: chunks
        started but not yet scored go first after a resume, under their group ids."""
        return {
            "step": self.step,
            "cursor": self.cursor,
            "next_group_id": self.next_group_id,
            "requeue": self.requeue.state(self.in_flight()),
        }

    def restore(self, state: dict, buffered: pa.Table) -> None:
        """Continue from `state()` and the buffer's table (`buffer.to_table()`) of a checkpoint
        taken with the learner idle."""
        self.step, self.cursor = state["step"], state["cursor"]
        self.next_group_id = state["next_group_id"]
        self.requeue = Requeue.from_state(state["requeue"])
        self.buffer.load_table(buffered)
        self._in_flight.clear()
        self._filtered_ids.clear()
        self.training = False

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        """Write `state()` (with the loop's `extra` entries) and the buffered groups."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.buffer.dump_parquet(directory / BUFFER_FILE)
        (directory / STATE_FILE).write_text(json.dumps({**self.state(), **(extra or {})}))

    def load(self, directory: str | Path) -> dict:
        """Restore what `save` wrote; returns the state read (with the loop's entries)."""
        directory = Path(directory)
        state = json.loads((directory / STATE_FILE).read_text())
        self.restore(state, pq.read_table(directory / BUFFER_FILE))
        return state
