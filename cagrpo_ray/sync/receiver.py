"""A generator worker's end of a weight sync (the protocol is in `sender.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from cagrpo_ray.sync.buckets import unpack_bucket
from cagrpo_ray.sync.group import (
    LEARNER_RANK,
    SyncAddress,
    WeightSyncError,
    abort,
    absent_ranks,
    as_sync_address,
    join_group,
    missing_keys,
    open_store,
    start_broadcast,
    sync_device,
    wait,
)
from cagrpo_ray.sync.sender import SyncStats

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], object]


class WeightReceiver:
    """Joins the learner's weight-sync group as `rank` (>= 1) and receives versions from it.

    Construction blocks until every rank of the group has joined (at most
    `address.timeout_s`). Inside a vLLM worker this is created by the worker extension; an
    in-process engine (the HF fallback) creates it directly.
    """

    def __init__(self, address: SyncAddress | dict, rank: int, device_id: str | None = None):
        address = as_sync_address(address)
        if not 1 <= rank < address.world_size:
            raise ValueError(
                f"a generator worker's sync rank must be in 1..{address.world_size - 1}, got {rank}"
            )
        self.address = address
        self.rank = rank
        host, world_size, timeout_s = address.host, address.world_size, address.timeout_s
        self._store = open_store(
            host, address.port, world_size, is_master=False, timeout_s=timeout_s
        )
        self._device = sync_device(address.backend)
        self._group = join_group(
            self._store, rank, world_size, address.backend, timeout_s, host, device_id,
            self._device, secret=address.secret,
        )  # fmt: skip
        self._buffers = BufferPool(self._device)

    def receive(self, version: int, load: LoadWeights) -> SyncStats:
        """Receive policy `version` from the learner; `load(named_tensors)` puts it in the model.

        Staged: every bucket is received into host memory first (the bucket buffers
        themselves on the CPU, a host copy of each bucket on a GPU), and `load` is called once,
        with the list of every tensor of the sync, only after the last bucket has arrived and
        the learner has confirmed that its send ended well (`sender.py`, step 4). So a sync
        that fails mid-transfer (a peer died, the learner gave up) raises `WeightSyncError`
        before anything of the model changed: the worker serves the previous version intact.
        If `load` raises, the learner's `send` fails naming this rank and the error, and the
        error reaches the caller unchanged.
        """
        what = f"weight sync v{version}"
        timeout_s = self.address.timeout_s
        start = time.perf_counter()
        ready = f"v{version}/ready"
        self._store.set(f"{ready}/{self.rank}", "1")
        if absent_ranks(self._store, ready, [LEARNER_RANK], timeout_s):
            self._store.delete_key(f"{ready}/{self.rank}")  # a later send must not count us
            raise WeightSyncError(
                f"{what}: learner (rank 0) did not send within {timeout_s:g} s "
                f"(generator worker rank {self.rank} waited; is learner rank 0 inside "
                f"WeightSender.send(..., version={version})?)"
            )

        totals = {"tensors": 0, "bytes": 0, "buckets": 0}
        staged = self._stage(version, totals)
        self._confirm_sent(version)
        loaded = f"v{version}/loaded/{self.rank}"
        try:
            load(staged)
        except Exception as exc:
            self._store.set(loaded, f"error: {type(exc).__name__}: {exc}"[:2000])
            raise
        del staged  # the views must not keep the bucket buffers from being reused
        self._buffers.trim(keep=totals["buckets"])
        self._store.set(loaded, "ok")
        seconds = time.perf_counter() - start
        return SyncStats(version, totals["tensors"], totals["bytes"], totals["buckets"], seconds)

    def _stage(self, version: int, totals: dict) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the sync, as views into host memory that nothing reuses before the
        load: the buckets' own buffers on the CPU (`BufferPool` reuses a buffer only once no
        view of it is held), a host copy of each bucket otherwise (its device buffer is then
        free for the next bucket)."""
        what = f"weight sync v{version}"
        first_size = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._wait(self._start(first_size), f"{what}: first bucket size")
        nbytes = int(first_size.item())
        bucket = self._buffers.take(nbytes)
        work = self._start(bucket)
        staged: list[tuple[str, torch.Tensor]] = []
        while True:
            index = totals["buckets"]
            self._wait(work, f"{what}: bucket {index} ({nbytes} bytes)")
            if bucket.device.type != "cpu":
                bucket = bucket.to("cpu")
            header, next_nbytes, tensors = unpack_bucket(bucket)
            if header.version != version or header.index != index:
                raise WeightSyncError(
                    f"{what}: generator worker rank {self.rank} expected bucket {index} "
                    f"of v{version} and got bucket {header.index} of v{header.version}"
                )
            if next_nbytes:
                following = self._buffers.take(next_nbytes)
                work = self._start(following)
            totals["tensors"] += len(tensors)
            totals["bytes"] += sum(slot.nbytes for slot in header.slots)
            totals["buckets"] += 1
            staged.extend(tensors)
            if not next_nbytes:
                return staged
            bucket, nbytes = following, next_nbytes

    def _confirm_sent(self, version: int) -> None:
        """Wait for the learner's end of send (`v<v>/sent`); raise unless it ended well."""
        what = f"weight sync v{version}"
        key = f"v{version}/sent"
        if missing_keys(self._store, [key], self.address.timeout_s):
            raise WeightSyncError(
                f"{what}: generator worker rank {self.rank} received every bucket but the "
                f"learner (rank 0) did not confirm the end of its send within "
                f"{self.address.timeout_s:g} s; the previous version stays loaded"
            )
        outcome = self._store.get(key).decode()
        if outcome != "ok":
            raise WeightSyncError(
                f"{what}: the learner's send failed after generator worker rank {self.rank} "
                f"received every bucket ({outcome}); the previous version stays loaded"
            )

    def _start(self, tensor: torch.Tensor):
        try:
            return start_broadcast(self._group, tensor, self.address.timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(f"weight sync: a broadcast failed to start: {exc}") from exc

    def _wait(self, work, what: str) -> None:
        try:
            wait(work, self.address.timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            abort(self._group)
            raise WeightSyncError(
                f"{what}: learner (rank 0) stopped sending mid-transfer (or gave up after "
                f"another worker failed); generator worker rank {self.rank} waited "
                f"{self.address.timeout_s:g} s ({exc}). The group is unusable now: the learner "
                "must build a new one."
            ) from exc

    def close(self) -> None:
        """Release the group (its NCCL communicator is freed only here, or by an abort)."""
        if self._group is not None:
            self._group.close()
        self._group = None
        self._store = None


class BufferPool:
    """Receive buffers, each reused once nothing outside the pool holds a view of it.

    Fresh memory costs page faults on first touch, about five times a copy of the same bytes
    on the CPU, so buffers are kept across buckets and syncs. A receive stages a whole version
    before loading it (the staged tensors are views of the buckets), so a buffer is free only
    when the use count of its storage is back to what it was when the pool alone held it;
    in-flight broadcasts hold it too.
    """

    def __init__(self, device: torch.device, keep: int = 3):
        self.device = device
        self.keep = keep  # free buffers kept between syncs
        self._buffers: list[tuple[torch.Tensor, int | None]] = []  # (buffer, idle use count)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes`, a view into a pooled buffer (held while it is used)."""
        for buffer, idle in self._buffers:
            if buffer.numel() >= nbytes and idle is not None and _use_count(buffer) == idle:
                return buffer[:nbytes]
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._buffers.append((buffer, _use_count(buffer)))
        return buffer[:nbytes]

    def trim(self, keep: int = 0) -> None:
        """Keep the max(`keep`, the pool's `keep`) largest free buffers (and every busy one);
        forget the others. A staged sync of n buckets on the CPU holds n buffers at once: kept
        for the next sync, which needs as many."""
        free, busy = [], []
        for entry in self._buffers:
            buffer, idle = entry
            (free if idle is not None and _use_count(buffer) == idle else busy).append(entry)
        free.sort(key=lambda entry: entry[0].numel(), reverse=True)
        self._buffers = busy + free[: max(keep, self.keep)]


def _use_count(tensor: torch.Tensor) -> int | None:
    """References to the tensor's storage (views included), or None where torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata)
