"""The generator pool: n generator replicas and everything known about them.

The pool owns its replicas' state and nobody else writes it: what each replica has in flight,
the policy version it samples with next, which replicas must get the current weights before
they serve again (restarted by Ray after a crash, or missed by a failed sync), how often a
replica was lost, and how long each was busy. Callers submit chunks of prompts to idle
replicas and hand back each finished object ref; a chunk whose replica died (or came back
from a restart with its initial weights) is returned as lost, for the caller to requeue.

`generate(prompts, sampling)` is the blocking, engine-like front for evaluation: prompts are
cut into small chunks and each replica takes the next chunk as soon as it returns the previous
one (work stealing through `ray.wait`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from .types import Completion, SamplingConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A request in flight: `tag` is the caller's label for it (e.g. its prompt indices)."""

    replica: int
    tag: Any
    version: int  # the weights the replica samples it with
    submitted: float  # time.monotonic() at submission


@dataclasses.dataclass(frozen=True)
class Finished:
    """A chunk that came back: its groups, or None when the replica was lost on the way."""

    chunk: Chunk
    groups: list[list[Completion]] | None

    @property
    def lost(self) -> bool:
        return self.groups is None


class GeneratorPool:
    """n generator actors (`GeneratorActor`), their versions, restarts and busy time."""

    def __init__(self, actors: list, chunk_prompts: int = 4, wait_warn_s: float = 60.0):
        self._actors = list(actors)
        self.chunk_prompts = chunk_prompts
        self.wait_warn_s = wait_warn_s
        self._in_flight: dict = {}  # ObjectRef -> Chunk
        self._next_version = [0] * len(actors)  # what each replica samples with next
        self._stale: set[int] = set()  # must get the current weights before serving
        self._restarts = 0
        self._busy = [0.0] * len(actors)  # seconds from submission to return, per replica

    # ------------------------------------------------------------------------ read-only views

    @property
    def num_replicas(self) -> int:
        return len(self._actors)

    @property
    def actors(self) -> tuple:
        return tuple(self._actors)

    @property
    def restarts(self) -> int:
        """Replicas lost so far (died, or found restarted with their initial weights)."""
        return self._restarts

    @property
    def busy_seconds(self) -> float:
        """Summed over replicas: the time their requests were running."""
        return sum(self._busy)

    @property
    def needs_weights(self) -> frozenset[int]:
        """Replicas that must be resynced before they serve again."""
        return frozenset(self._stale)

    def version(self, replica: int) -> int:
        """The policy version `replica` samples its next request with."""
        return self._next_version[replica]

    def idle_replicas(self) -> list[int]:
        """Replicas with nothing in flight that may serve (not waiting for a resync)."""
        busy = {chunk.replica for chunk in self._in_flight.values()}
        return [r for r in range(self.num_replicas) if r not in busy and r not in self._stale]

    # ------------------------------------------------------------------------- requests

    def submit(self, replica: int, prompts: list[list[int]], sampling: SamplingConfig, tag) -> None:
        """Send one chunk of prompts to `replica`; it comes back through `finish(ref)`."""
        ref = self._actors[replica].generate.remote(prompts, sampling)
        self._in_flight[ref] = Chunk(replica, tag, self._next_version[replica], time.monotonic())

    def in_flight(self) -> list:
        """Object refs of the chunks in flight (to `ray.wait` on, with anything else)."""
        return list(self._in_flight)

    def in_flight_tags(self) -> list:
        return [chunk.tag for chunk in self._in_flight.values()]

    def owns(self, ref) -> bool:
        return ref in self._in_flight

    def finish(self, ref) -> Finished:
        """The result of a finished ref of `in_flight()`; lost if its replica died or restarted."""
        chunk = self._in_flight.pop(ref)
        try:
            groups = ray.get(ref)
        except RayActorError as exc:
            log.warning("generator replica %d died (%s); its chunk is requeued", chunk.replica, exc)
            self.lose(chunk.replica)
            return Finished(chunk, None)
        self._busy[chunk.replica] += time.monotonic() - chunk.submitted
        versions = {c.policy_version for group in groups for c in group}
        if versions and min(versions) < chunk.version:
            # Restarted since we last called it (Ray queues calls while it restarts an actor):
            # it answered with its initial weights.
            log.warning(
                "generator replica %d answered with policy versions %s, expected >= %d; "
                "resyncing it",
                chunk.replica,
                sorted(versions),
                chunk.version,
            )
            self.lose(chunk.replica)
            return Finished(chunk, None)
        return Finished(chunk, groups)

    def drain(self) -> list[Finished]:
        """Wait for every chunk in flight; their results in completion order."""
        finished = []
        while self._in_flight:
            done, _ = ray.wait(list(self._in_flight), num_returns=1)
            finished.append(self.finish(done[0]))
        return finished

    # ---------------------------------------------------------------------------- weights

    def lose(self, replica: int) -> None:
        """`replica` died or restarted: count it, and resync it before it serves again.

        One death is often seen twice (its chunk and its weight receive both fail); it is
        counted once: a replica already waiting for a resync is not counted again."""
        if replica not in self._stale:
            self._restarts += 1
        self._stale.add(replica)

    def mark_stale(self, replicas) -> None:
        """A sync did not reach `replicas`: they must be resynced before they serve again."""
        self._stale.update(replicas)

    def join_weight_sync(self, address: dict, workers_per_replica: int) -> list:
        """Every replica's workers join the learner's weight-sync group (as ranks 1.. in
        replica order); the refs, which resolve once the group has formed."""
        return [
            actor.init_weight_sync.remote(address, 1 + i * workers_per_replica)
            for i, actor in enumerate(self._actors)
        ]

    def receive_weights(self, version: int) -> list:
        """Queue `receive_weights(version)` on every replica (behind the chunk each is
        generating, so no request is cut in half); requests submitted from now on sample
        with `version`. The refs resolve when each replica has loaded it."""
        self._next_version = [version] * self.num_replicas
        return [actor.receive_weights.remote(version) for actor in self._actors]

    def loaded(self, version: int) -> None:
        """Every replica now holds `version` (a sync succeeded)."""
        self._next_version = [version] * self.num_replicas
        self._stale.clear()

    def await_ready(self, timeout_s: float = 900.0) -> None:
        """Wait until every replica answers (Ray refuses calls while it restarts an actor)."""
        deadline = time.monotonic() + timeout_s
        for replica, actor in enumerate(self._actors):
            while True:
                try:
                    ray.get(actor.ready.remote(), timeout=self.wait_warn_s)
                    break
                except (RayActorError, GetTimeoutError) as exc:
                    if time.monotonic() > deadline:
                        message = f"generator replica {replica} did not come back"
                        raise RuntimeError(message) from exc
                    log.warning("waiting for generator replica %d to restart", replica)
                    time.sleep(1.0)

    # ---------------------------------------------------------------- blocking generation

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        resync: Callable[[], None] | None = None,
    ) -> list[list[Completion]]:
        """Generate `sampling.n` completions per prompt over all replicas; prompt order kept.

        Chunks of `chunk_prompts` prompts, each seeded by its position (`chunk_sampling`), so
        the samples of a prompt do not depend on which replica drew them. A lost chunk is
        generated again; before a replica that needs weights serves, `resync()` is called.
        Call it with nothing else in flight.
        """
        chunks = deque(
            (start, prompts[start : start + self.chunk_prompts])
            for start in range(0, len(prompts), self.chunk_prompts)
        )
        results: list[list[Completion] | None] = [None] * len(prompts)
        while chunks or self._in_flight:
            idle = deque(self.idle_replicas())
            if chunks and not idle and self._stale and not self._in_flight:
                if resync is None:
                    raise RuntimeError(
                        f"generator replicas {sorted(self._stale)} need weights and no resync "
                        "was given"
                    )
                resync()
                continue
            while chunks and idle:
                start, chunk = chunks.popleft()
                self.submit(idle.popleft(), chunk, chunk_sampling(sampling, start), (start, chunk))
            done, _ = ray.wait(self.in_flight(), num_returns=1, timeout=self.wait_warn_s)
            if not done:
                log.warning(
                    "waited %.0f s for generator replicas %s (%d chunks queued)",
                    self.wait_warn_s,
                    sorted({c.replica for c in self._in_flight.values()}),
                    len(chunks),
                )
                continue
            finished = self.finish(done[0])
            start, chunk = finished.chunk.tag
            if finished.lost:
                chunks.appendleft((start, chunk))
                continue
            results[start : start + len(chunk)] = finished.groups
        return results  # type: ignore[return-value]


def chunk_sampling(sampling: SamplingConfig, start: int) -> SamplingConfig:
    """Per-chunk seed: the samples of a prompt do not depend on which replica drew them."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed * 1_000_003 + start)
