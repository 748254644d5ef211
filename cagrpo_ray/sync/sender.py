"""The learner's end of a weight sync: bucketed broadcast from learner rank 0.

One sync of version v, as both ends see it (keys live in the group's own `TCPStore`):

1. each generator worker writes `v<v>/ready/<rank>` and waits for the learner's key;
2. the learner waits for every worker's key (a timeout names the absent workers), then writes
   `v<v>/ready/0` (a worker's timeout here says the learner did not send);
3. a broadcast of the first bucket's size, then one broadcast per bucket (`buckets.py`); each
   bucket carries the next one's size, so both ends keep one bucket in flight while they pack
   (learner) or stage (workers) another;
4. once its last broadcast is done the learner writes `v<v>/sent`: "ok", or "failed: ..." when
   its send failed (a worker died mid-transfer, a tensor could not be gathered);
5. each worker stages the whole version (`receiver.py`) and loads it into its model only once
   it holds the last bucket and reads "ok" there: a sync that fails anywhere before leaves
   every surviving worker serving the previous version intact;
6. each worker writes `v<v>/loaded/<rank>` after its load, and `send` returns when all have
   (so its time covers the weights being in every engine).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cagrpo_ray.sync.buckets import group_into_buckets, pack_bucket, plan_bucket
from cagrpo_ray.sync.group import (
    LEARNER_RANK,
    SyncAddress,
    WeightSyncError,
    abort,
    absent_ranks,
    describe_ranks,
    join_bound_s,
    join_group,
    new_secret,
    open_store,
    resolve_backend,
    start_broadcast,
    sync_device,
    wait,
)


@dataclass(frozen=True)
class SyncStats:
    version: int
    num_tensors: int
    num_bytes: int  # tensor bytes moved (without headers and padding)
    num_buckets: int
    seconds: float  # from the start of the sync until every receiver had loaded the weights


class WeightSender:
    """Learner rank 0's end of the weight-sync group.

    Construction returns at once: it starts the group's `TCPStore` (on `port`, or a free port
    when `port=0`; read it back from `.address`) and joins the group from a background thread,
    because the group forms only when every generator worker has joined too. `send` waits for
    that join. Create the sender once the generator engines are up, hand `.address` to them,
    then have each call its `init_weight_sync(address, rank_offset)`.

    `world_size` counts this rank and every generator worker rank. Every wait is bounded by
    `timeout_s` and fails with a `WeightSyncError` naming the rank that did not come. A failure
    inside a broadcast leaves the group unusable: close the sender and build a new group.

    The store listens on `host` only, and admits only members that prove they hold this
    group's secret (made here, fresh for every sender; it travels in `.address`, so hand the
    address to the generators only through the run's own Ray calls).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        world_size: int = 2,
        backend: str = "auto",
        timeout_s: float = 60.0,
        bucket_mb: float = 64.0,
        device_id: str | None = None,
    ):
        if world_size < 2:
            raise ValueError(f"world_size counts the learner and >= 1 worker, got {world_size}")
        self.host = host
        self.world_size = world_size
        self.backend = resolve_backend(backend)
        self.timeout_s = timeout_s
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._secret = new_secret()
        self._store = open_store(host, port, world_size, is_master=True, timeout_s=timeout_s)
        self.port = self._store.port
        self._device = sync_device(self.backend)
        self._joiner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync-join")
        self._group_future = self._joiner.submit(
            join_group, self._store, LEARNER_RANK, world_size, self.backend, timeout_s, host,
            device_id, self._device, secret=self._secret,
        )  # fmt: skip
        self._buffers = [torch.empty(0, dtype=torch.uint8, device=self._device) for _ in range(2)]
        self._broken: str | None = None
        self._announced: int | None = None  # the version `announce` was last called for
        self.version: int | None = None  # last version every receiver loaded

    @property
    def address(self) -> SyncAddress:
        return SyncAddress(
            self.host, self.port, self.world_size, self.backend, self.timeout_s, self._secret
        )

    def wait_joined(self) -> None:
        """Block until every generator worker has joined; raise naming those that did not."""
        self._group("weight sync")

    def _group(self, what: str):
        if self._broken:
            raise WeightSyncError(f"{what}: the group is unusable after: {self._broken}")
        # join_group bounds each of its waits, the transport's formation included: this
        # bound is a backstop only.
        limit_s = join_bound_s(self.timeout_s) + 60
        try:
            return self._group_future.result(timeout=limit_s)
        except WeightSyncError as exc:
            raise WeightSyncError(f"{what}: {exc}") from exc
        except TimeoutError as exc:
            self._broken = "the group did not form"
            raise WeightSyncError(
                f"{what}: joining the {self.backend} group did not end within {limit_s:g} s, "
                "past the bound of each of its waits; build a new group"
            ) from exc

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Broadcast `named_tensors` as policy `version` to every generator worker.

        `named_tensors` are full (unsharded) tensors with the Hugging Face parameter names the
        engines' `load_weights` expects. It is consumed lazily, one bucket ahead of the bucket
        being packed, so each tensor must stay valid until about two buckets later (live
        parameters and fresh copies do). Returns once every worker has loaded them.
        """
        what = f"weight sync v{version}"
        start = time.perf_counter()
        if self._announced != version:
            self.announce(version)
        group = self._group(what)
        workers = list(range(1, self.world_size))

        try:
            num_tensors, num_bytes, num_buckets = self._broadcast(group, named_tensors, version)
        except Exception as exc:
            # Receivers may be left mid-stream: the group is not reused. They load nothing
            # without this key, so they keep serving the previous version.
            self._broken = self._broken or f"{what}: the send failed"
            self._store.set(f"v{version}/sent", f"failed: {type(exc).__name__}: {exc}"[:2000])
            raise
        self._store.set(f"v{version}/sent", "ok")

        absent = absent_ranks(self._store, f"v{version}/loaded", workers, self.timeout_s)
        if absent:
            raise WeightSyncError(
                f"{what}: {describe_ranks(absent)} received the weights but did not confirm "
                f"loading them within {self.timeout_s:g} s"
            )
        for rank in workers:
            outcome = self._store.get(f"v{version}/loaded/{rank}").decode()
            if outcome != "ok":
                raise WeightSyncError(
                    f"{what}: generator worker rank {rank} failed to load: "
                    f"{outcome.removeprefix('error: ')}"
                )
        for key in ("ready", "loaded"):
            for rank in range(self.world_size):
                self._store.delete_key(f"v{version}/{key}/{rank}")
        self._store.delete_key(f"v{version}/sent")
        self.version = version
        return SyncStats(version, num_tensors, num_bytes, num_buckets, time.perf_counter() - start)

    def _broadcast(
        self, group, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> tuple[int, int, int]:
        """The first bucket's size, then every bucket; returns (tensors, bytes, buckets)."""
        what = f"weight sync v{version}"
        buckets = (
            plan_bucket(tensors, version, index)
            for index, tensors in enumerate(group_into_buckets(named_tensors, self.bucket_bytes))
        )
        current = next(buckets)
        first_size = torch.tensor([current.nbytes], dtype=torch.int64, device=self._device)
        self._wait(self._start(group, first_size), f"{what}: first bucket size")
        in_flight = None
        num_tensors = num_bytes = num_buckets = 0
        while current is not None:
            following = next(buckets, None)  # pulled (a ZeRO-3 gather) while a bucket flies
            buffer = self._bucket_buffer(num_buckets % 2, current.nbytes)
            pack_bucket(current, following.nbytes if following else 0, buffer)
            if in_flight is not None:
                self._wait(*in_flight)  # frees the other buffer for the next bucket
            description = f"{what}: bucket {num_buckets} ({current.nbytes} bytes)"
            in_flight = (self._start(group, buffer), description)
            num_tensors += len(current.tensors)
            num_bytes += sum(slot.nbytes for slot in current.header.slots)
            num_buckets += 1
            current = following
        self._wait(*in_flight)
        return num_tensors, num_bytes, num_buckets

    def announce(self, version: int) -> None:
        """Wait until every generator worker is inside `receive(version)`, then tell them the
        learner is sending. Raises, naming the absent workers, after `timeout_s`.

        `send` does it first; a caller whose other ranks must not start work for the sync
        before the workers are there (ZeRO-3's parameter gathers) calls it on its own first.
        """
        what = f"weight sync v{version}"
        self._group(what)
        workers = list(range(1, self.world_size))
        absent = absent_ranks(self._store, f"v{version}/ready", workers, self.timeout_s)
        if absent:
            raise WeightSyncError(
                f"{what}: {describe_ranks(absent)} did not arrive within {self.timeout_s:g} s "
                f"(is its engine inside receive_weights({version})?)"
            )
        self._store.set(f"v{version}/ready/{LEARNER_RANK}", "1")
        self._announced = version

    def _bucket_buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        # Two buffers, reused across buckets and syncs: one is packed while the other flies.
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._buffers[slot][:nbytes]

    def _start(self, group, tensor: torch.Tensor):
        try:
            return start_broadcast(group, tensor, self.timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            self._broken = "a broadcast failed to start"
            raise WeightSyncError(f"weight sync: a broadcast failed to start: {exc}") from exc

    def _wait(self, work, what: str) -> None:
        try:
            wait(work, self.timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            self._broken = f"{what} failed"
            abort(self._group_future.result())
            raise WeightSyncError(
                f"{what} did not complete within {self.timeout_s:g} s although every generator "
                f"worker had arrived: a worker died or stalled mid-transfer ({exc}). The group "
                "is unusable now: close this sender and build a new group."
            ) from exc

    def close(self) -> None:
        """Release the group (now, or once a join still under way ends) and stop serving the
        store (receivers' next wait fails, naming us)."""
        self._joiner.shutdown(wait=False, cancel_futures=True)
        self._broken = self._broken or "the sender was closed"
        if self._group_future is not None:
            self._group_future.add_done_callback(_close_transport)
        self._group_future = None
        self._store = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_transport(joined: Future) -> None:
    if not joined.cancelled() and joined.exception() is None:
        joined.result().close()  # an NCCL communicator is freed only by an explicit abort
