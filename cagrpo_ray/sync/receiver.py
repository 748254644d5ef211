"""A generator worker's end of a weight sync (the protocol is in `sender.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

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
    open_store,
    start_broadcast,
    sync_device,
    wait,
)
from cagrpo_ray.sync.sender import SyncStats

LoadWeights = Callable[[Iterator[tuple[str, torch.Tensor]]], object]


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

        `load` gets one iterator over every tensor of the sync, which runs the broadcasts as it
        is consumed (so a model loader that processes a layer only once all its tensors are in
        sees them all in one call). Each bucket has its own buffer: the tensors stay valid for
        as long as `load` holds them. Whatever `load` leaves unconsumed is received and dropped,
        so that the learner is never left mid-send; if `load` raises, the learner's `send`
        fails naming this rank and the error.
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
        stream = self._stream(version, totals)
        loaded = f"v{version}/loaded/{self.rank}"
        try:
            load(stream)
        except WeightSyncError:
            raise  # the transfer itself failed: the group is broken, nothing left to drain
        except Exception as exc:
            for _ in stream:
                pass
            self._store.set(loaded, f"error: {type(exc).__name__}: {exc}"[:2000])
            raise
        for _ in stream:
            pass
        self._store.set(loaded, "ok")
        seconds = time.perf_counter() - start
        return SyncStats(version, totals["tensors"], totals["bytes"], totals["buckets"], seconds)

    def _stream(self, version: int, totals: dict) -> Iterator[tuple[str, torch.Tensor]]:
        what = f"weight sync v{version}"
        first_size = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._wait(self._start(first_size), f"{what}: first bucket size")
        nbytes = int(first_size.item())
        bucket = self._buffers.take(nbytes)
        work = self._start(bucket)
        while True:
            index = totals["buckets"]
            self._wait(work, f"{what}: bucket {index} ({nbytes} bytes)")
            header, next_nbytes, tensors = unpack_bucket(bucket)
            if header.version != version or header.index != index:
                raise WeightSyncError(
                    f"{what}: generator worker rank {self.rank} expected bucket {index} "
                    f"of v{version} and got bucket {header.index} of v{header.version}"
                )
            if next_nbytes:  # receive the next bucket while this one is being loaded
                following = self._buffers.take(next_nbytes)
                work = self._start(following)
            totals["tensors"] += len(tensors)
            totals["bytes"] += sum(slot.nbytes for slot in header.slots)
            totals["buckets"] += 1
            yield from tensors
            del tensors  # our own views must not keep the bucket's buffer from being reused
            if not next_nbytes:
                self._buffers.trim()
                return
            bucket, nbytes = following, next_nbytes

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
    on the CPU, so buffers are kept across buckets and syncs. A loader may hold a bucket's
    tensors past the bucket (vLLM's reload keeps a layer's tensors until all of them are in),
    so a buffer is free only when the use count of its storage is back to what it was when
    the pool alone held it; in-flight broadcasts hold it too.
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

    def trim(self) -> None:
        """Keep the `keep` largest free buffers (and every busy one); forget the others."""
        free, busy = [], []
        for entry in self._buffers:
            buffer, idle = entry
            (free if idle is not None and _use_count(buffer) == idle else busy).append(entry)
        free.sort(key=lambda entry: entry[0].numel(), reverse=True)
        self._buffers = busy + free[: self.keep]


def _use_count(tensor: torch.Tensor) -> int | None:
    """References to the tensor's storage (views included), or None where torch cannot say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata)
