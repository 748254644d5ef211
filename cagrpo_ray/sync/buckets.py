"""Flat byte buckets of named tensors: what one broadcast of a weight sync carries.

A bucket is one uint8 buffer: a JSON header (sync version, bucket index, whether it is the last
bucket, and each tensor's name, dtype, shape and byte offset), padded to `ALIGN` bytes, then the
tensors' bytes, each starting at an `ALIGN`-byte boundary so that the receiver can view them in
place as their own dtype. Tensors of any dtype share a bucket; a tensor larger than the bucket
size travels alone in a bucket of its own size.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; a multiple of every dtype's size, and of a cache line


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
    last: bool  # no bucket follows in this sync
    slots: tuple[TensorSlot, ...]

    def encode(self) -> bytes:
        slots = [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in self.slots]
        body = {"version": self.version, "index": self.index, "last": self.last, "slots": slots}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BucketHeader:
        body = json.loads(raw)
        slots = tuple(
            TensorSlot(name, dtype, tuple(shape), offset, nbytes)
            for name, dtype, shape, offset, nbytes in body["slots"]
        )
        return cls(body["version"], body["index"], body["last"], slots)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def group_into_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Yield (tensors of one bucket, is_last), consuming the iterable lazily.

    A bucket is closed before the tensor that would push its data past `bucket_bytes`, so that a
    streaming source (a ZeRO-3 gather, for example) holds at most about one bucket at a time.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = aligned(tensor.numel() * tensor.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    yield bucket, True


@dataclass(frozen=True)
class PlannedBucket:
    header: BucketHeader
    encoded_header: bytes
    nbytes: int  # header (padded to ALIGN) + data


def plan_bucket(
    tensors: list[tuple[str, torch.Tensor]], version: int, index: int, last: bool
) -> PlannedBucket:
    """Lay out a bucket holding `tensors`: their slots, the encoded header, the total size."""
    slots, offset = [], 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        slots.append(TensorSlot(name, dtype, tuple(tensor.shape), offset, nbytes))
        offset += aligned(nbytes)
    header = BucketHeader(version, index, last, tuple(slots))
    encoded = header.encode()
    return PlannedBucket(header, encoded, aligned(len(encoded)) + offset)


def pack_bucket(
    tensors: list[tuple[str, torch.Tensor]], plan: PlannedBucket, out: torch.Tensor
) -> None:
    """Write the header and the bytes of `tensors` into the uint8 buffer `out[:plan.nbytes]`."""
    encoded = plan.encoded_header
    out[: len(encoded)].copy_(torch.frombuffer(bytearray(encoded), dtype=torch.uint8))
    start = aligned(len(encoded))
    for (_, tensor), slot in zip(tensors, plan.header.slots, strict=True):
        if slot.nbytes:
            region = out[start + slot.offset : start + slot.offset + slot.nbytes]
            region.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())


def unpack_bucket(
    buffer: torch.Tensor, header_nbytes: int
) -> tuple[BucketHeader, list[tuple[str, torch.Tensor]]]:
    """The header of a received bucket and views (no copies) of its tensors inside `buffer`."""
    header = BucketHeader.decode(bytes(buffer[:header_nbytes].cpu().numpy()))
    start = aligned(header_nbytes)
    tensors = []
    for slot in header.slots:
        region = buffer[start + slot.offset : start + slot.offset + slot.nbytes]
        dtype = getattr(torch, slot.dtype)
        tensors.append((slot.name, region.view(dtype).view(slot.shape)))
    return header, tensors
