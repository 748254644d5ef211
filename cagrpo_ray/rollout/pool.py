"""Spreading prompts over generator replicas so that none idles while another has a queue.

Prompts are cut into small chunks; each replica takes the next chunk as soon as it returns the
previous one (work stealing through `ray.wait`). A replica that dies loses only its chunk,
which goes back to the queue; Ray restarts the actor, and the pool's owner brings it up to the
current weights before it serves again (`needs_weights`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from .types import Completion, SamplingConfig

log = logging.getLogger(__name__)


class GeneratorPool:
    """Engine-like front of n generator actors: `generate(prompts, sampling)` in prompt order."""

    def __init__(
        self,
        actors: list,
        chunk_prompts: int = 4,
        wait_warn_s: float = 60.0,
        on_restart: Callable[[int], None] | None = None,
    ):
        self.actors = actors
        self.chunk_prompts = chunk_prompts
        self.wait_warn_s = wait_warn_s
        self.on_restart = on_restart  # called with a replica index before it serves again
        self.needs_weights: set[int] = set()
        self.restarts = 0
        self.policy_version = 0
        self.busy_seconds = [0.0] * len(actors)  # per replica, for idle fractions

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        chunks = deque(
            (start, prompts[start : start + self.chunk_prompts])
            for start in range(0, len(prompts), self.chunk_prompts)
        )
        results: list[list[Completion] | None] = [None] * len(prompts)
        running: dict = {}  # ObjectRef -> (replica, start, chunk, submitted_at)
        free = deque(range(len(self.actors)))
        while chunks or running:
            while chunks and free:
                replica = free.popleft()
                if replica in self.needs_weights and self.on_restart is not None:
                    self.on_restart(replica)
                    self.needs_weights.discard(replica)
                start, chunk = chunks.popleft()
                seeded = _chunk_sampling(sampling, start)
                ref = self.actors[replica].generate.remote(chunk, seeded)
                running[ref] = (replica, start, chunk, time.monotonic())
            done, _ = ray.wait(list(running), num_returns=1, timeout=self.wait_warn_s)
            if not done:
                waiting = sorted({running[r][0] for r in running})
                log.warning(
                    "waited %.0f s for generator replicas %s (%d chunks queued)",
                    self.wait_warn_s,
                    waiting,
                    len(chunks),
                )
                continue
            ref = done[0]
            replica, start, chunk, submitted = running.pop(ref)
            try:
                outputs = ray.get(ref)
            except RayActorError as exc:
                log.warning("generator replica %d died (%s); its chunk is requeued", replica, exc)
                self.restarts += 1
                self.needs_weights.add(replica)
                chunks.appendleft((start, chunk))
                free.append(replica)
                continue
            self.busy_seconds[replica] += time.monotonic() - submitted
            versions = {c.policy_version for group in outputs for c in group}
            if versions and versions != {self.policy_version}:
                # Restarted between our calls (Ray queues calls while it restarts the actor):
                # it answered with its initial weights. Resync it and redo the chunk.
                log.warning(
                    "generator replica %d answered with policy versions %s instead of %d; "
                    "resyncing it",
                    replica,
                    sorted(versions),
                    self.policy_version,
                )
                self.restarts += 1
                self.needs_weights.add(replica)
                chunks.appendleft((start, chunk))
                free.append(replica)
                continue
            results[start : start + len(chunk)] = outputs
            free.append(replica)
        return results  # type: ignore[return-value]


def _chunk_sampling(sampling: SamplingConfig, start: int) -> SamplingConfig:
    """Per-chunk seed: the samples of a prompt do not depend on which replica drew them."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed * 1_000_003 + start)
