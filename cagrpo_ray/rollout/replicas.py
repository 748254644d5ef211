"""The generator replicas' state, one record per replica, without Ray.

Each replica is in one phase, and its record changes only through the transitions below, each
of which checks the phase it leaves:

    phase       serves?  what it is                                   leaves by
    READY       yes      samples with `version`                       start_load, lose
    LOADING     no       a weight load is under way (`load`)          load_done, load_failed, lose
                                                                      (start_load: a load after it)
    LOST        no       died; Ray has not restarted it yet           back, lose
    RESTARTED   no       back, with its initial weights               start_load, lose

    start_load(r, v)   READY | RESTARTED -> LOADING; r samples with v once it has loaded
                       (LOADING: the new load follows the unreported one; LOST: nothing
                       changes, the load cannot reach it, and False is returned)
    load_done(r, v)    LOADING with a load of v -> READY at v (anything else: ignored, the
                       load no longer holds: r was lost since it began)
    load_failed(r)     LOADING -> the phase and version it had before the load, `behind` if it
                       was serving (it keeps serving its version, as far as the staleness bound
                       admits, until a sync reaches it); not LOADING: ignored (seen twice)
    lose(r)            any -> LOST (counted unless it was already awaiting its resync)
    back(r)            LOST -> RESTARTED
    submitted(r, n)    READY only: n prompts more in flight
    returned(r, n)     n prompts fewer in flight

A replica needs weights when it is LOST or RESTARTED (it serves only after a resync) or
`behind`; a resync can reach it now unless it is LOST. `available(chunk)` are the READY
replicas under the per-replica prompt limit, least loaded first, and none at all while a
replica with nothing in flight is loading (it serves in a moment, and the work waits for it
rather than all going to the first replica to finish loading). The generator pool
(`pool.py`) keeps the Ray calls and asks this table; the schedule's model test drives it too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    READY = "ready"
    LOADING = "loading"
    LOST = "lost"
    RESTARTED = "restarted"


class ReplicaStateError(RuntimeError):
    """A transition from a phase it may not leave (a bug in the caller, never a fault)."""


@dataclass(frozen=True)
class Load:
    """A weight load under way: the version it loads, and what the replica had before it."""

    version: int
    before_version: int
    before_phase: Phase  # READY or RESTARTED
    before_behind: bool


@dataclass
class Replica:
    phase: Phase = Phase.READY
    version: int = 0  # the version its next request samples with (a load's, while LOADING)
    behind: bool = False  # a sync failed on it: it serves an older version than the learner's
    load: Load | None = None  # while LOADING
    prompts: int = 0  # prompts in flight


class ReplicaTable:
    """The records of `n` replicas (module docstring). `max_prompts_in_flight`: per replica,
    0 for no limit."""

    def __init__(self, n: int, max_prompts_in_flight: int = 0):
        self.replicas = [Replica() for _ in range(n)]
        self.max_prompts_in_flight = max_prompts_in_flight
        self.restarts = 0  # replicas lost so far, each loss counted once

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, replica: int) -> Replica:
        return self.replicas[replica]

    # ---------------------------------------------------------------- transitions

    def start_load(self, replica: int, version: int) -> bool:
        """`replica` begins loading `version`; False (nothing changes) if it is LOST. A load
        started while another is unreported follows it (a replica loads in call order): it
        leaves what the earlier one left, at the earlier one's version."""
        r = self.replicas[replica]
        if r.phase is Phase.LOST:
            return False
        if r.phase is Phase.LOADING:
            earlier = r.load
            r.load = Load(version, earlier.version, earlier.before_phase, earlier.before_behind)
        else:
            self._leaving(replica, Phase.READY, Phase.RESTARTED)
            r.load = Load(version, r.version, r.phase, r.behind)
        r.phase, r.version = Phase.LOADING, version
        return True

    def load_done(self, replica: int, version: int) -> None:
        """`replica` loaded `version`, if that is the load it has under way."""
        r = self.replicas[replica]
        if r.phase is not Phase.LOADING or r.load is None or r.load.version != version:
            return
        r.phase, r.version, r.behind, r.load = Phase.READY, version, False, None

    def load_failed(self, replica: int) -> None:
        """`replica`'s load failed with the replica alive, before its model changed."""
        r = self.replicas[replica]
        if r.phase is not Phase.LOADING or r.load is None:
            return
        load = r.load
        r.phase, r.version, r.load = load.before_phase, load.before_version, None
        r.behind = load.before_behind or load.before_phase is Phase.READY

    def lose(self, replica: int) -> bool:
        """`replica` died (or answered with its initial weights); True if it was not lost
        already (the caller then probes it, to learn when Ray has restarted it)."""
        r = self.replicas[replica]
        if r.phase is Phase.LOST:
            return False
        if not self._awaiting_resync(r):
            self.restarts += 1  # one awaiting its resync, found out again: the same loss
        r.phase, r.load, r.behind = Phase.LOST, None, False
        return True

    @staticmethod
    def _awaiting_resync(r: Replica) -> bool:
        loading_back = r.phase is Phase.LOADING and r.load.before_phase is Phase.RESTARTED
        return r.phase is Phase.RESTARTED or loading_back

    def back(self, replica: int) -> None:
        """Ray restarted the lost `replica`: it answers, with its initial weights."""
        self._leaving(replica, Phase.LOST)
        self.replicas[replica].phase = Phase.RESTARTED

    def submitted(self, replica: int, prompts: int) -> None:
        self._leaving(replica, Phase.READY, what="take a request")
        self.replicas[replica].prompts += prompts

    def returned(self, replica: int, prompts: int) -> None:
        r = self.replicas[replica]
        if prompts > r.prompts:
            raise ReplicaStateError(
                f"generator replica {replica} returned {prompts} prompts of {r.prompts} in flight"
            )
        r.prompts -= prompts

    def _leaving(self, replica: int, *phases: Phase, what: str = "") -> None:
        phase = self.replicas[replica].phase
        if phase not in phases:
            allowed = " or ".join(p.name for p in phases)
            raise ReplicaStateError(
                f"generator replica {replica} is {phase.name}: only a replica {allowed} can "
                f"{what or 'make this transition'}"
            )

    # ---------------------------------------------------------------- queries

    def phase(self, replica: int) -> Phase:
        return self.replicas[replica].phase

    def version(self, replica: int) -> int:
        return self.replicas[replica].version

    def in_phase(self, *phases: Phase) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.phase in phases]

    @property
    def loading(self) -> bool:
        return any(r.phase is Phase.LOADING for r in self.replicas)

    @property
    def needs_weights(self) -> frozenset[int]:
        """LOST or RESTARTED (they serve only after a resync), or behind (they serve an older
        version meanwhile)."""
        return frozenset(
            i
            for i, r in enumerate(self.replicas)
            if r.phase in (Phase.LOST, Phase.RESTARTED) or r.behind
        )

    @property
    def needs_weights_now(self) -> frozenset[int]:
        """Of `needs_weights`, those a resync can reach: all but the LOST."""
        return frozenset(i for i in self.needs_weights if self.replicas[i].phase is not Phase.LOST)

    def live(self) -> list[int]:
        """The replicas that answer: all but the LOST."""
        return [i for i, r in enumerate(self.replicas) if r.phase is not Phase.LOST]

    def available(self, chunk: int = 1) -> list[int]:
        """The replicas that may take a chunk of `chunk` prompts now, least loaded first; none
        while a replica with nothing in flight is loading (module docstring)."""
        if any(r.phase is Phase.LOADING and r.prompts == 0 for r in self.replicas):
            return []
        limit = self.max_prompts_in_flight
        ready = [
            i
            for i, r in enumerate(self.replicas)
            if r.phase is Phase.READY and (limit <= 0 or r.prompts + chunk <= limit)
        ]
        return sorted(ready, key=lambda i: (self.replicas[i].prompts, i))

    def state(self) -> str:
        """Each replica's next version and prompts in flight, and which are loading, stale
        (LOST or RESTARTED), behind and lost, in one line (for errors)."""
        stale = self.in_phase(Phase.LOST, Phase.RESTARTED)
        behind = [i for i, r in enumerate(self.replicas) if r.behind]
        return (
            f"versions {[r.version for r in self.replicas]}, "
            f"prompts in flight {[r.prompts for r in self.replicas]}, "
            f"loading {self.in_phase(Phase.LOADING)}, stale {stale}, behind {behind}, "
            f"lost {self.in_phase(Phase.LOST)}"
        )
