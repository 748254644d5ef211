"""The dedicated weight-sync process group and its named rendezvous.

Rank 0 is the learner's rank 0; ranks 1.. are generator workers (one per vLLM worker process,
so a tensor-parallel engine takes several). The group is a transport (`transport.py`) over its
own `TCPStore`: a standalone `ProcessGroupGloo` on CPU, vLLM's `PyNcclCommunicator` on GPU;
never the default `torch.distributed` group, which on the learner belongs to DeepSpeed.

A raw collective whose peer never comes blocks until its timeout and then says nothing about
who is missing. So every rendezvous goes through the store first: each rank writes a key
(`joined/<rank>`, `v<version>/ready/<rank>`) and waits for the others' keys, and a timeout
names the ranks whose keys are missing. Only then does the data collective start.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cagrpo_ray.sync.transport import GlooTransport, PyNcclTransport

LEARNER_RANK = 0
BACKENDS = ("gloo", "nccl")


class WeightSyncError(RuntimeError):
    """A weight-sync rendezvous or collective failed; the message names the side that failed."""


@dataclass(frozen=True)
class SyncAddress:
    """Where generator workers find the learner's weight-sync group (a Ray-serialisable value)."""

    host: str
    port: int
    world_size: int  # 1 learner rank + every generator worker rank
    backend: str  # "gloo" | "nccl"
    timeout_s: float


def as_sync_address(address: SyncAddress | dict) -> SyncAddress:
    """Accept the address itself or its `dataclasses.asdict` form (what crosses an RPC)."""
    return address if isinstance(address, SyncAddress) else SyncAddress(**address)


def rank_name(rank: int) -> str:
    return "learner (rank 0)" if rank == LEARNER_RANK else f"generator worker rank {rank}"


def describe_ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return rank_name(ranks[0])
    learner = [rank_name(r) for r in ranks if r == LEARNER_RANK]
    workers = [str(r) for r in ranks if r != LEARNER_RANK]
    if workers:
        learner.append(f"generator worker ranks {', '.join(workers)}")
    return ", ".join(learner)


def resolve_backend(backend: str) -> str:
    """'auto' is NCCL where CUDA is available and gloo elsewhere."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"weight sync backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def sync_device(backend: str) -> torch.device:
    """Where the broadcast buffers live: NCCL moves CUDA tensors, gloo CPU tensors."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def open_store(host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float):
    """The learner's `TCPStore` (master, `port=0` picks a free one) or a worker's client of it.

    The master does not wait for workers (`wait_for_workers=False`): it must return so that the
    learner can go on while the workers join.
    """
    timeout = timedelta(seconds=timeout_s)
    if is_master:
        return dist.TCPStore(
            host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
    try:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    except (RuntimeError, dist.DistError) as exc:
        raise WeightSyncError(
            f"weight sync: the learner's store at {host}:{port} was not reachable within "
            f"{timeout_s:g} s (has learner rank 0 created its WeightSender?): {exc}"
        ) from exc


def missing_keys(store, keys: list[str], timeout_s: float) -> list[str]:
    """Wait until every key exists; return those still missing after `timeout_s` (none: [])."""
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        return []
    except (RuntimeError, dist.DistError):
        return [key for key in keys if not store.check([key])]


def absent_ranks(store, key: str, ranks: list[int], timeout_s: float) -> list[int]:
    """Wait until every rank in `ranks` has written `<key>/<rank>`; return the ranks that have not
    after `timeout_s` (an empty list when all arrived)."""
    missing = missing_keys(store, [f"{key}/{r}" for r in ranks], timeout_s)
    return sorted(int(k.rsplit("/", 1)[1]) for k in missing)


def join_group(
    store,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    host: str,
    device_id: str | None = None,
    device: torch.device | None = None,
):
    """Every rank calls this once; returns the group's transport (`GlooTransport` for "gloo",
    `PyNcclTransport` for "nccl") after all `world_size` ranks have joined.

    `device` holds the rank's broadcast tensors (by default `sync_device(backend)` of the
    calling thread; the learner joins from a thread of its own, so it passes its device).
    Each rank announces its device (`device_id`, by default its GPU's UUID under NCCL): NCCL
    refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") only at the
    first collective, deep inside a broadcast; here every rank fails at once, naming the ranks
    and the GPU.
    """
    device = sync_device(backend) if device is None else device
    store.set(f"device/{rank}", device_id or local_device_id(device))
    store.set(f"joined/{rank}", "1")
    ranks = absent_ranks(store, "joined", list(range(world_size)), timeout_s)
    if ranks:
        raise WeightSyncError(
            f"{describe_ranks(ranks)} did not join the weight-sync group ({backend}, "
            f"world size {world_size}) within {timeout_s:g} s"
        )
    shared = shared_devices({r: store.get(f"device/{r}").decode() for r in range(world_size)})
    if shared:
        gpu, ranks = next(iter(shared.items()))
        raise WeightSyncError(
            f"{describe_ranks(ranks)} of the weight-sync group are on the same GPU {gpu}: "
            "NCCL refuses two ranks of one communicator on one device. Layouts where a "
            "generator and a learner share a GPU are not supported; give each role its own GPUs"
        )
    group_store = dist.PrefixStore("group/", store)
    if backend != "nccl":
        return GlooTransport(group_store, rank, world_size, timeout_s, host)
    # Not ProcessGroupNCCL: its watchdog, which ends the whole process on a peer's death under
    # TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3, would put learner rank 0 at the mercy of every
    # generator worker (see `transport.py`). PyNccl has no watchdog; our waits bound each
    # broadcast, and an abort costs only this group.
    try:
        return PyNcclTransport(group_store, rank, world_size, device)
    except (RuntimeError, dist.DistError) as exc:
        raise WeightSyncError(
            f"{rank_name(rank)} could not form the weight-sync NCCL communicator (world size "
            f"{world_size}) on {device}: {exc}"
        ) from exc


def local_device_id(device: torch.device) -> str:
    """What a rank's tensors of the group live on: its GPU's UUID for a CUDA device, else
    "cpu"."""
    if device.type != "cuda":
        return "cpu"
    return f"GPU-{torch.cuda.get_device_properties(device.index).uuid}"


def shared_devices(devices: dict[int, str]) -> dict[str, list[int]]:
    """{device: ranks} for every GPU that more than one rank announced ("cpu" is shared
    freely)."""
    by_device: dict[str, list[int]] = {}
    for rank, device in sorted(devices.items()):
        by_device.setdefault(device, []).append(rank)
    return {d: r for d, r in by_device.items() if d != "cpu" and len(r) > 1}


def abort(transport) -> None:
    """Give up on a transport after a failed wait, so that no rank stays blocked in it; it is
    unusable afterwards (gloo: its own timeout has already ended the wait; NCCL: the
    communicator is aborted, which ends only this group)."""
    transport.abort()


def start_broadcast(transport, tensor: torch.Tensor, timeout_s: float):
    """Start broadcasting `tensor` in place from the learner (rank 0); returns the work.

    Every rank must start its broadcasts in the same order.
    """
    return transport.start_broadcast(tensor, LEARNER_RANK, timeout_s)


def wait(work, timeout_s: float) -> None:
    work.wait(timedelta(seconds=timeout_s))
