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
    absent_ranks,
    as_sync_address,
    broadcast,
    join_group,
    open_store,
    sync_device,
)
from cagrpo_ray.sync.sender import SyncStats

LoadWeights = Callable[[Iterator[tuple[str, torch.Tensor]]], object]


class WeightReceiver:
    """Joins the learner's weight-sync group as `rank` (>= 1) and receives versions from it.

    Construction blocks until every rank of the group has joined (at most
    `address.timeout_s`). Inside a vLLM worker this is created by the worker extension; an
    in-process engine (the HF fallback) creates it directly.
    """

    def __init__(self, address: SyncAddress | dict, rank: int):
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
        self._group = join_group(self._store, rank, world_size, address.backend, timeout_s, host)
        self._device = sync_device(address.backend)

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
        sizes = torch.zeros(2, dtype=torch.int64, device=self._device)
        while True:
            index = totals["buckets"]
            self._broadcast(sizes, f"{what}: bucket {index} sizes")
            header_nbytes, nbytes = (int(x) for x in sizes.tolist())
            bucket = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            self._broadcast(bucket, f"{what}: bucket {index} ({nbytes} bytes)")
            header, tensors = unpack_bucket(bucket, header_nbytes)
            if header.version != version or header.index != index:
                raise WeightSyncError(
                    f"{what}: generator worker rank {self.rank} expected bucket {index} "
                    f"of v{version} and got bucket {header.index} of v{header.version}"
                )
            totals["tensors"] += len(tensors)
            totals["bytes"] += sum(slot.nbytes for slot in header.slots)
            totals["buckets"] += 1
            yield from tensors
            if header.last:
                return

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            broadcast(self._group, tensor, self.address.timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            raise WeightSyncError(
                f"{what}: learner (rank 0) stopped sending mid-transfer; generator worker rank "
                f"{self.rank} waited {self.address.timeout_s:g} s ({exc}). The group is "
                "unusable now: the learner must build a new one."
            ) from exc

    def close(self) -> None:
        self._group = None
        self._store = None
