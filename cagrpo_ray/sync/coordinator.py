"""The driver's side of weight sync: the learner group's rank 0 sends, every replica receives.

`WeightSyncCoordinator` builds the sync group (learner rank 0's `WeightSender` plus every
generator worker's `WeightReceiver`, see `sender.py`) and moves one policy version into every
replica, in one of two ways:

- `sync(version)` blocks until every replica has loaded it; a replica that dies during the
  sync (or a sync that times out) costs a rebuilt group and another attempt, not the run;
- `start(version)` / `finish()` split it in two, so the driver can go on while the replicas
  load the new weights between two of their requests. A failure marks every replica for a
  `resync`, done once the learner is idle (its weights are then exactly the version sent).

The pool learns of every outcome through its own methods (`loaded`, `mark_stale`, `lose`).

Under LoRA every sync is acknowledged: the learner's send returns the checksum of the adapter
it sent, each replica's receive the checksum of the adapter it now serves (read back from
what it registered), and a replica whose checksum differs stops the run with
`AdapterMismatchError` naming it. That is not a fault to retry (the group and the processes
are fine; the generator would sample from an adapter the learner never trained): it is a bug
that would otherwise pass in silence, the generators sampling a stale or partial adapter while
training appears to work.
This module is driver code (it talks to Ray actors); the weight-moving classes of this package
(`WeightSender`, `WeightReceiver`) need neither Ray nor vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayError

log = logging.getLogger("cagrpo_ray")


class AdapterMismatchError(RuntimeError):
    """A replica serves another LoRA adapter than the learner sent (never retried)."""


class WeightSyncCoordinator:
    """Moves the learner group's weights into the generator pool's replicas.

    learners: a `LearnerGroup`; pool: a `GeneratorPool`; workers_per_replica: weight-sync
    ranks per replica (its tensor-parallel size); backend, timeout_s, bucket_mb: the sync
    group's (see `WeightSender`); wait(refs, what): `ray.get` that logs long waits.
    """

    def __init__(
        self,
        learners,
        pool,
        workers_per_replica: int,
        backend: str,
        timeout_s: float,
        bucket_mb: float,
        wait: Callable[[list, str], list],
    ):
        self.learners, self.pool = learners, pool
        self.workers_per_replica = workers_per_replica
        self.backend, self.timeout_s, self.bucket_mb = backend, timeout_s, bucket_mb
        self._wait = wait
        self._receives: list = []  # the split-phase sync in flight: replicas' refs
        self._sends: list = []  # ... and the learner ranks' refs
        self._version = 0
        self._started = 0.0
        self.last: dict[str, float] = {}  # seconds and bytes of the last completed sync

    def build_group(self) -> None:
        """(Re)build the sync group: learner rank 0 plus every replica's workers."""
        world = 1 + self.workers_per_replica * self.pool.num_replicas
        address = self.learners.open_weight_sender(
            world, self.backend, self.timeout_s, self.bucket_mb
        )
        refs = self.pool.join_weight_sync(address, self.workers_per_replica)
        self._wait(refs, "generator workers to join the weight-sync group")

    # ------------------------------------------------------------------------ blocking

    def sync(self, version: int, attempts: int = 3) -> dict[str, float]:
        """Load `version` into every replica now; returns {"sync/seconds", "sync/bytes"}."""
        start = time.perf_counter()
        for attempt in range(1, attempts + 1):
            receives = self.pool.receive_weights(version)
            sent = self.learners.collect(self.learners.submit_send_weights(version), "sync")[0]
            problems = self._problems(receives, sent, version)
            if not problems:
                self.pool.loaded(version)
                self.last = {
                    "sync/seconds": time.perf_counter() - start,
                    "sync/bytes": sent["num_bytes"],
                }
                return dict(self.last)
            log.warning(
                "weight sync v%d, attempt %d of %d failed; rebuilding the group: %s",
                version,
                attempt,
                attempts,
                "; ".join(p[:300] for p in problems),
            )
            self.pool.await_ready()
            self.build_group()
        raise RuntimeError(f"weight sync v{version} failed {attempts} times; see the log")

    def resync(self, version: int) -> dict[str, float]:
        """After a replica restarted or a sync failed: rebuild the group and load `version`
        everywhere. Call it with the learner idle and no generation in flight."""
        self.finish()
        log.warning("resyncing generator replicas %s", sorted(self.pool.needs_weights))
        self.pool.await_ready()
        self.build_group()
        return self.sync(version)

    # --------------------------------------------------------------------- split phase

    def start(self, version: int) -> None:
        """Queue `version` behind each replica's current request and start the send."""
        self._version, self._started = version, time.perf_counter()
        self._receives = self.pool.receive_weights(version)
        self._sends = self.learners.submit_send_weights(version)

    def pending(self) -> list:
        """The refs of the sync in flight that have not resolved yet."""
        refs = self._receives + self._sends
        if not refs:
            return []
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        return pending

    def finish(self) -> None:
        """Wait for the sync in flight (if any). On success the pool holds its version and
        `last` its timing; on failure every replica is marked for a resync."""
        if not self._receives and not self._sends:
            return
        receives, sends = self._receives, self._sends
        self._receives, self._sends = [], []
        version = self._version
        sent = self.learners.collect(sends, "weight send")[0]
        problems = self._problems(receives, sent, version)
        if problems:
            log.warning(
                "weight sync v%d failed (%s); every replica will be resynced",
                version,
                "; ".join(p[:300] for p in problems),
            )
            self.pool.mark_stale(range(self.pool.num_replicas))
            return
        self.pool.loaded(version)
        self.last = {
            "sync/seconds": time.perf_counter() - self._started,
            "sync/bytes": sent["num_bytes"],
        }

    # ------------------------------------------------------------------------- plumbing

    def _problems(self, receives: list, sent: dict, version: int) -> list[str]:
        """Wait for every replica's receive; what went wrong, learner side included.

        Raises `AdapterMismatchError` (module docstring) when the learner sent a LoRA adapter
        ("adapter_checksum" in `sent`) and a replica that loaded it acknowledges another."""
        problems = [] if "error" not in sent else [f"learner: {sent['error']}"]
        mismatches = []
        for replica, ref in enumerate(receives):
            try:
                (received,) = self._wait([ref], f"generator {replica} to load weights v{version}")
            except RayError as exc:
                problems.append(f"generator {replica}: {type(exc).__name__}: {exc}")
                if isinstance(exc, RayActorError):
                    self.pool.lose(replica)
                continue
            expected = sent.get("adapter_checksum")
            if expected is not None and received.get("adapter_checksum") != expected:
                mismatches.append(
                    f"generator replica {replica} serves adapter "
                    f"{received.get('adapter_checksum')} (the learner sent {expected})"
                )
        if mismatches:
            raise AdapterMismatchError(
                f"weight sync v{version}: the LoRA adapter a generator serves is not the one "
                f"the learner sent: {'; '.join(mismatches)}. Its samples would come from an "
                "adapter the learner never trained; the run stops (a bug in the sync, not a "
                "fault to retry)."
            )
        return problems
