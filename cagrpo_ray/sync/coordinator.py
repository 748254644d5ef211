"""The driver's side of weight sync: the learner group's rank 0 sends, every replica receives.

`WeightSyncCoordinator` builds the sync group (learner rank 0's `WeightSender` plus the
workers of every live generator replica, see `sender.py`) and moves one policy version into
its members, in one of two ways:

- `sync(version)` blocks until every member has loaded it; a replica that dies during the
  sync (or a sync that times out) costs a group rebuilt from the live replicas and another
  attempt, not the run;
- `start(version)` / `finish()` split it in two, so the driver can go on while the replicas
  load the new weights between two of their requests.

A generator lost during a sync costs only itself. Each replica's outcome is its own: one that
loaded holds the new version; one whose receive failed while it stayed up still serves the
version it had (a receiver loads only a whole version, confirmed by the learner:
`receiver.py`), and keeps serving it as far as the staleness bound admits, marked as needing
weights; one that died is lost until Ray restarts it. The next sync first rebuilds the group
from the live replicas (`resync`, once the learner is idle: its weights are then exactly the
version sent, or the next `start`), without waiting for the lost one; when Ray has restarted
it, it needs weights (`GeneratorPool.needs_weights_now`) and the resync that follows brings it
back into the group. The pool learns of every outcome through its own methods (`loaded`,
`missed_sync`, `lose`).

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
        self._receives: list = []  # the split-phase sync in flight: members' refs
        self._members: tuple[int, ...] = ()  # ... the replicas they belong to
        self._sends: list = []  # ... and the learner ranks' refs
        self._broken = False  # the last sync failed: rebuild the group before the next
        self._version = 0
        self._started = 0.0
        self.last: dict[str, float] = {}  # seconds and bytes of the last completed sync

    def build_group(self, attempts: int = 3) -> None:
        """(Re)build the sync group: learner rank 0 plus the workers of every live replica
        (waits for a lost one only while none is live). A replica found dead while the group
        forms is lost, and the group is formed again without it."""
        for _ in range(attempts):
            replicas = self.pool.live_replicas()
            world = 1 + self.workers_per_replica * len(replicas)
            address = self.learners.open_weight_sender(
                world, self.backend, self.timeout_s, self.bucket_mb
            )
            log.info(
                "weight-sync group: %d ranks, the learner's store at %s:%d",
                world, address["host"], address["port"],
            )  # fmt: skip
            refs = self.pool.join_weight_sync(address, self.workers_per_replica, replicas)
            problems = []
            for replica, ref in zip(replicas, refs, strict=True):
                try:
                    self._wait([ref], f"generator {replica} to join the weight-sync group")
                except RayError as exc:
                    problems.append(f"generator {replica}: {type(exc).__name__}: {exc}")
                    if isinstance(exc, RayActorError):
                        self.pool.lose(replica)
            if not problems:
                self._broken = False
                return
            log.warning(
                "the weight-sync group did not form (%s); forming it again",
                "; ".join(p[:300] for p in problems),
            )
        raise RuntimeError(f"the weight-sync group did not form {attempts} times; see the log")

    def _ensure_group(self) -> None:
        """Rebuild the group after a failed sync, or once a member was lost since it formed
        (a send to it would only wait out the sync timeout)."""
        if self._broken or not set(self.pool.members) <= set(self.pool.live_replicas()):
            self.build_group()

    # ------------------------------------------------------------------------ blocking

    def sync(self, version: int, attempts: int = 3) -> dict[str, float]:
        """Load `version` into every live replica now; returns {"sync/seconds",
        "sync/bytes"}."""
        start = time.perf_counter()
        for attempt in range(1, attempts + 1):
            self._ensure_group()
            members = self.pool.members
            receives = self.pool.receive_weights(version)
            sent = self.learners.collect(self.learners.submit_send_weights(version), "sync")[0]
            problems = self._problems(members, receives, sent, version)
            if not problems:
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
        raise RuntimeError(f"weight sync v{version} failed {attempts} times; see the log")

    def resync(self, version: int) -> dict[str, float]:
        """After a replica restarted or a sync failed: rebuild the group from the live
        replicas and load `version` into them. Call it with the learner idle and no generation
        in flight."""
        self.finish()
        log.warning("resyncing generator replicas %s", sorted(self.pool.needs_weights_now))
        self.build_group()
        return self.sync(version)

    # --------------------------------------------------------------------- split phase

    def start(self, version: int) -> None:
        """Queue `version` behind each replica's current request and start the send."""
        self._ensure_group()
        self._version, self._started = version, time.perf_counter()
        self._members = self.pool.members
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
        `last` its timing; on failure each replica's outcome is its own (module docstring)."""
        if not self._receives and not self._sends:
            return
        receives, sends = self._receives, self._sends
        self._receives, self._sends = [], []
        version = self._version
        sent = self.learners.collect(sends, "weight send")[0]
        problems = self._problems(self._members, receives, sent, version)
        if problems:
            log.warning(
                "weight sync v%d failed (%s); replicas %s will be resynced",
                version,
                "; ".join(p[:300] for p in problems),
                sorted(self.pool.needs_weights),
            )
            return
        self.last = {
            "sync/seconds": time.perf_counter() - self._started,
            "sync/bytes": sent["num_bytes"],
        }

    # ------------------------------------------------------------------------- plumbing

    def _problems(self, members, receives: list, sent: dict, version: int) -> list[str]:
        """Wait for every member's receive and tell the pool each one's outcome (module
        docstring); what went wrong, learner side included. A failed sync marks the group for
        a rebuild.

        Raises `AdapterMismatchError` (module docstring) when the learner sent a LoRA adapter
        ("adapter_checksum" in `sent`) and a replica that loaded it acknowledges another."""
        problems = [] if "error" not in sent else [f"learner: {sent['error']}"]
        mismatches, loaded = [], []
        for replica, ref in zip(members, receives, strict=True):
            try:
                (received,) = self._wait([ref], f"generator {replica} to load weights v{version}")
            except RayError as exc:
                problems.append(f"generator {replica}: {type(exc).__name__}: {exc}")
                if isinstance(exc, RayActorError):
                    self.pool.lose(replica)
                else:
                    self.pool.missed_sync([replica])
                continue
            loaded.append(replica)
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
        self.pool.loaded(version, loaded)
        self._broken = bool(problems)
        return problems
