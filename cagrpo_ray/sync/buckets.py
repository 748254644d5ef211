"""Flat byte buckets of named tensors: what one broadcast of a weight sync carries.

A bucket is one uint8 buffer:

    [header bytes: int64][next bucket's bytes: int64, 0 after the last bucket]
    [JSON header: version, bucket index, each tensor's name, dtype, shape, offset, size]
    [padding to ALIGN][tensor bytes, each starting at an ALIGN boundary]

The receiver views each tensor in place as its own dtype (no copy). Tensors of any dtype share
a bucket; a tensor larger than the bucket size travels alone in a bucket of its own size.
Because every bucket announces the size of the next, a receiver can post the next receive
before it loads the current bucket, and the transfer overlaps the loading.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; a multiple of every dtype's size, and of a cache line
PREFIX = 16  # two int64: header bytes, next bucket's bytes


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket's data region
    nbytes: int


@dataclass(frozen=True)
class BucketHeader:
    version: int  # policy version being sent
    index: int  # 0-based bucket number within this sync
    slots: tuple[TensorSlot, ...]

    def encode(self) -> bytes:
        slots = [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]
        body = {"version": self.version, "index": self.index, "slots": slots}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BucketHeader:
        body = json.loads(raw)
        slots = tuple(
            TensorSlot(name, dtype, tuple(shape), offset, nbytes)
            for name, dtype, shape, offset, nbytes in body["slots"]
        )
        return cls(body["version"], body["index"], slots)


@dataclass(frozen=True)
class PlannedBucket:
    tensors: list[tuple[str, torch.Tensor]]
    header: BucketHeader
    encoded_header: bytes
    nbytes: int  # prefix + header (padded to ALIGN) + data

    @property
    def data_start(self) -> int:
        return aligned(PREFIX + len(self.encoded_header))


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def group_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the tensors of one bucket at a time, consuming the iterable lazily; always at
    least one (possibly empty) bucket.

    A bucket is closed before the tensor that would push its data past `bucket_bytes`, so that a
    streaming source (a ZeRO-3 gather, for example) holds about one bucket at a time.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = aligned(tensor.numel() * tensor.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    yield bucket


def plan_bucket(tensors: list[tuple[str, torch.Tensor]], version: int, index: int) -> PlannedBucket:
    """Lay out a bucket holding `tensors`: their slots, the encoded header, the total size."""
    slots, offset = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        slots.append(TensorSlot(name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += aligned(nbytes)
    header = BucketHeader(version, index, tuple(slots))
    encoded = header.encode()
    return PlannedBucket(tensors, header, encoded, aligned(PREFIX + len(encoded)) + offset)


def pack_bucket(plan: PlannedBucket, next_nbytes: int, out: torch.Tensor) -> None:
    """Write the bucket into the uint8 buffer `out` (`plan.nbytes` long); `next_nbytes` is the
    size of the bucket that follows (0: none)."""
    encoded = plan.encoded_header
    out[:PREFIX].view(torch.int64).copy_(torch.tensor([len(encoded), next_nbytes]))
    out[PREFIX : PREFIX + len(encoded)].copy_(
        torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    )
    start = plan.data_start
    for (_, tensor), slot in zip(plan.tensors, plan.header.slots, strict=True):
        if slot.nbytes:
            region = out[start + slot.offset : start + slot.offset + slot.nbytes]
            region.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())


def unpack_bucket(buffer: torch.Tensor) -> tuple[BucketHeader, int, list[tuple[str, torch.Tensor]]]:
    """A received bucket's header, the next bucket's size (0: none), and views (no copies) of
    its tensors inside `buffer`."""
    header_nbytes, next_nbytes = buffer[:PREFIX].view(torch.int64).tolist()
    raw = bytes(buffer[PREFIX : PREFIX + header_nbytes].cpu().numpy())
    header = BucketHeader.decode(raw)
    start = aligned(PREFIX + header_nbytes)
    tensors = []
    for slot in header.slots:
        region = buffer[start + slot.offset : start + slot.offset + slot.nbytes]
        tensors.append((slot.name, region.view(getattr(torch, slot.dtype)).view(slot.shape)))
    return header, next_nbytes, tensors
