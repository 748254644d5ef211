"""The dedicated weight-sync process group and its named rendezvous.

Rank 0 is the learner's rank 0; ranks 1.. are generator workers (one per vLLM worker process,
so a tensor-parallel engine takes several). The group is a transport (`transport.py`) over its
own `TCPStore`: a standalone `ProcessGroupGloo` on CPU, vLLM's `PyNcclCommunicator` on GPU;
never the default `torch.distributed` group, which on the learner belongs to DeepSpeed.

A raw collective whose peer never comes blocks until its timeout and then says nothing about
who is missing. So every rendezvous goes through the store first: each rank writes a key
(`joined/<rank>`, `v<version>/ready/<rank>`) and waits for the others' keys, and a timeout
names the ranks whose keys are missing. Only then does the data collective start.

Forming the transport after the `joined/` rendezvous is a wait of its own: it returns only once
every rank has come to it, and NCCL's (`ncclCommInitRank` and a warm-up all-reduce) has no
timeout. A rank that dies after writing its join key would leave the others there for good.
So the transport is formed in a thread of its own, bounded by the group's timeout, while each
rank counts up its `forming/<rank>` key; when the bound runs out, the ranks whose count did not
move are named (`form_transport`).

Only the run's own ranks are admitted (docs/architecture.md, "Who may join"): the learner's
store listens only on the address the members use, and every member proves that it holds the
group's secret (a random token that the learner made and the run handed to the members
through Ray calls) before the learner joins the group with it; the members check the
learner's proof in turn. `TCPStore` itself has no authentication: the proofs are HMACs over a
fresh challenge, written to and read from the store.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cagrpo_ray.sync.transport import GlooTransport, PyNcclTransport

LEARNER_RANK = 0
BACKENDS = ("gloo", "nccl")
LOOPBACK = "127.0.0.1"
ADMISSION_POLL_S = 0.05
FORMING_BEAT_S = 0.25  # how often a rank forming the transport counts up its `forming/` key
# After the bound runs out, how long a rank watches the others' counts before naming those
# that did not move: several beats, so that a rank that is alive but slow is not named.
ABSENCE_WATCH_S = 8 * FORMING_BEAT_S
JOIN_WAITS = 4  # the learner's challenge, every rank's join key, admission, the transport


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
    # The group's admission secret (hex), made by the learner for this group only; kept out of
    # repr so that logs and error messages that print an address never show it.
    secret: str = field(repr=False)


def new_secret() -> str:
    """A fresh admission secret for one weight-sync group: 256 random bits, hex."""
    return secrets.token_hex(32)


def proof(secret: str, *parts: object) -> str:
    """HMAC-SHA256 under `secret` of the parts joined by "|" (hex): what a rank writes to show
    that it holds the secret, bound to the group's challenge and to what it claims."""
    message = "|".join(str(p) for p in parts).encode()
    return hmac.new(bytes.fromhex(secret), message, hashlib.sha256).hexdigest()


def sync_host(node_ip: str, single_node: bool) -> str:
    """The address the learner's store listens on and the members dial: loopback when the
    whole cluster is one node (nothing off the machine can reach the store), else the learner
    node's IP (which every node must reach)."""
    return LOOPBACK if single_node else node_ip


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

    The master listens on `host` only (`listening_store`) and does not wait for workers: it
    must return so that the learner can go on while the workers join.
    """
    if is_master:
        return listening_store(host, port, world_size, timeout_s)
    try:
        return dist.TCPStore(
            host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    except (RuntimeError, dist.DistError) as exc:
        raise WeightSyncError(
            f"weight sync: the learner's store at {host}:{port} was not reachable within "
            f"{timeout_s:g} s (has learner rank 0 created its WeightSender?): {exc}"
        ) from exc


def listening_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A master `TCPStore` that listens on `host` only (`port` 0: a free one), and returns
    without waiting for the other ranks. torch's own master (and `env://`'s) listens on every
    interface; here the socket is bound first and handed to it (`master_listen_fd`, which it
    then owns)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    bound_port = listener.getsockname()[1]
    return dist.TCPStore(
        host, bound_port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=listener.detach(),
    )  # fmt: skip


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


def join_bound_s(timeout_s: float) -> float:
    """The longest `join_group` can take with the group's timeout `timeout_s` (s): each of its
    `JOIN_WAITS` waits is bounded by it, and naming the ranks absent from the transport's
    formation watches them for `ABSENCE_WATCH_S` more. A wait on someone else's join (a
    Ray call, a future) that is longer than this is a backstop only."""
    return JOIN_WAITS * timeout_s + ABSENCE_WATCH_S


def publish_challenge(store, secret: str) -> str:
    """Learner (rank 0): write a fresh challenge and the learner's proof over it; returns the
    challenge."""
    challenge = secrets.token_hex(16)
    store.set("auth/challenge", challenge)
    store.set("auth/learner", proof(secret, challenge, "learner"))
    return challenge


def present_proof(store, rank: int, secret: str, timeout_s: float, where: str) -> str:
    """Member `rank`: check the learner's proof, then append this rank's own; returns the
    challenge. Appended, not set, so that a stranger's entry cannot erase a member's."""
    if missing_keys(store, ["auth/challenge", "auth/learner"], timeout_s):
        raise WeightSyncError(
            f"{rank_name(rank)}: the weight-sync store at {where} has no challenge from the "
            f"learner after {timeout_s:g} s (has learner rank 0 created its WeightSender?)"
        )
    challenge = store.get("auth/challenge").decode()
    learner_proof = store.get("auth/learner").decode()
    if not hmac.compare_digest(learner_proof, proof(secret, challenge, "learner")):
        raise WeightSyncError(
            f"{rank_name(rank)} was refused: the weight-sync store at {where} and this rank do "
            "not share the group's secret (an address from another run or an earlier group; "
            "take the address the learner's current WeightSender gives)"
        )
    store.append(f"auth/member/{rank}", proof(secret, challenge, "member", rank) + ";")
    return challenge


def admit_members(store, world_size: int, secret: str, challenge: str, timeout_s: float):
    """Learner (rank 0): admit each member rank once one of the entries under its name is its
    proof over `challenge` (entries that are not are counted as refused), writing a proof of
    admission for it. Raises naming the ranks that no valid proof came for within
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pending, refused = set(range(1, world_size)), 0
    while True:
        for rank in sorted(pending):
            entries = store.get(f"auth/member/{rank}").decode().split(";")[:-1]
            expected = proof(secret, challenge, "member", rank)
            if any(hmac.compare_digest(entry, expected) for entry in entries):
                store.set(f"auth/admitted/{rank}", proof(secret, challenge, "admitted", rank))
                pending.discard(rank)
            else:
                refused = max(refused, len(entries))
        if not pending:
            return
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"{describe_ranks(sorted(pending))} did not prove the group's secret within "
                f"{timeout_s:g} s ({refused} entries without it refused): whatever wrote "
                "those ranks' keys is not this run's generator worker"
            )
        time.sleep(ADMISSION_POLL_S)


def await_admission(store, rank: int, secret: str, challenge: str, timeout_s: float) -> None:
    """Member `rank`: wait for the learner's proof that it admitted this rank."""
    key = f"auth/admitted/{rank}"
    if missing_keys(store, [key], timeout_s):
        raise WeightSyncError(
            f"learner (rank 0) did not admit {rank_name(rank)} to the weight-sync group within "
            f"{timeout_s:g} s"
        )
    if not hmac.compare_digest(store.get(key).decode(), proof(secret, challenge, "admitted", rank)):
        raise WeightSyncError(
            f"{rank_name(rank)}: the admission in the weight-sync store is not the learner's "
            "(it does not carry the group's secret); refusing to join"
        )


class SignedStore:
    """The group's store as vLLM's `StatelessProcessGroup` sees it (the NCCL path), which
    unpickles what it reads: a value read from a store that any client can write would run
    that client's code. Here every value is written with HMAC-SHA256(secret, challenge|key|
    value) in front, and one without a valid tag is refused before anything unpickles it.
    The tag binds the key and the group's challenge, so a value cannot be moved to another key
    or replayed into a later group. Pure Python: `StatelessProcessGroup` calls only `set`,
    `get` and `delete_key`."""

    TAG_BYTES = 32

    def __init__(self, store, secret: str, challenge: str):
        self.store = store
        self._key = bytes.fromhex(secret)
        self._challenge = challenge.encode()

    def _tag(self, key: str, value: bytes) -> bytes:
        message = self._challenge + b"|" + key.encode() + b"|" + value
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.store.set(key, self._tag(key, value) + value)

    def get(self, key: str) -> bytes:
        raw = self.store.get(key)
        tag, value = raw[: self.TAG_BYTES], raw[self.TAG_BYTES :]
        if not hmac.compare_digest(tag, self._tag(key, value)):
            raise WeightSyncError(
                f"weight sync: the value at {key!r} in the group's store does not carry the "
                "group's secret (a client outside the run wrote it); refused before use"
            )
        return value

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)


def join_group(
    store,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    host: str,
    device_id: str | None = None,
    device: torch.device | None = None,
    *,
    secret: str,
):
    """Every rank calls this once; returns the group's transport (`GlooTransport` for "gloo",
    `PyNcclTransport` for "nccl") after all `world_size` ranks have joined and the learner has
    admitted every member.

    Admission: the learner publishes a challenge with its proof; each member checks that
    proof (refusing a store that does not hold `secret`) and presents its own; after the
    `joined/` rendezvous the learner admits each member whose proof is right, and each
    member checks its proof of admission. Only then does any rank form the transport
    (`form_transport`). Each wait is bounded by `timeout_s`, the whole join by
    `join_bound_s(timeout_s)`.

    `device` holds the rank's broadcast tensors (by default `sync_device(backend)` of the
    calling thread; the learner joins from a thread of its own, so it passes its device).
    Each rank announces its device (`device_id`, by default its GPU's UUID under NCCL): NCCL
    refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") only at the
    first collective, deep inside a broadcast; here every rank fails at once, naming the ranks
    and the GPU.
    """
    device = sync_device(backend) if device is None else device
    if rank == LEARNER_RANK:
        challenge = publish_challenge(store, secret)
        for member in range(1, world_size):
            store.append(f"auth/member/{member}", "")  # exists, so admission can read it
    else:
        challenge = present_proof(store, rank, secret, timeout_s, f"{host}:{store.port}")
    store.set(f"device/{rank}", device_id or local_device_id(device))
    store.set(f"joined/{rank}", "1")
    ranks = absent_ranks(store, "joined", list(range(world_size)), timeout_s)
    if ranks:
        raise WeightSyncError(
            f"{describe_ranks(ranks)} did not join the weight-sync group ({backend}, "
            f"world size {world_size}) within {timeout_s:g} s"
        )
    if rank == LEARNER_RANK:
        admit_members(store, world_size, secret, challenge, timeout_s)
    else:
        await_admission(store, rank, secret, challenge, timeout_s)
    shared = shared_devices({r: store.get(f"device/{r}").decode() for r in range(world_size)})
    if shared:
        gpu, ranks = next(iter(shared.items()))
        raise WeightSyncError(
            f"{describe_ranks(ranks)} of the weight-sync group are on the same GPU {gpu}: "
            "NCCL refuses two ranks of one communicator on one device. Layouts where a "
            "generator and a learner share a GPU are not supported; give each role its own GPUs"
        )
    # On a connection of its own: a store client serves one request at a time, and the
    # transport's rendezvous blocks in its reads while this thread counts up its `forming/` key.
    group_store = dist.PrefixStore("group/", another_connection(store))
    if backend != "nccl":
        return form_transport(
            store, rank, world_size, timeout_s, f"the weight-sync gloo group on {host}",
            lambda: GlooTransport(group_store, rank, world_size, timeout_s, host),
        )  # fmt: skip
    # Not ProcessGroupNCCL: its watchdog, which ends the whole process on a peer's death under
    # TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3, would put learner rank 0 at the mercy of every
    # generator worker (see `transport.py`). PyNccl has no watchdog; our waits bound each
    # broadcast, and an abort costs only this group.
    return form_transport(
        store, rank, world_size, timeout_s, f"the weight-sync NCCL communicator on {device}",
        lambda: PyNcclTransport(SignedStore(group_store, secret, challenge), rank, world_size,
                                device),
    )  # fmt: skip


def form_transport(
    store, rank: int, world_size: int, timeout_s: float, what: str, make: Callable[[], object]
):
    """Run `make()`, the construction of the group's transport (`what`, for messages), which
    returns only once every rank has called it; raise a `WeightSyncError` naming the ranks
    that did not come if it has not returned within `timeout_s` (or raised).

    `make` runs in a daemon thread, while this thread counts up `forming/<rank>` in `store`
    every `FORMING_BEAT_S`. When the bound runs out (or `make` fails), this rank keeps
    counting and watches the others' counts for `ABSENCE_WATCH_S` (`absent_from_formation`):
    a rank whose count is 0 wrote its join key but never began forming (it died or stalled
    after joining); one whose count stopped died or failed while forming. If every count
    moves, the setup itself hung with all ranks in it.

    A construction that never returns cannot be stopped from outside (NCCL gives a
    communicator to abort only once `ncclCommInitRank` returns), so its thread is left
    behind, blocked, until the process ends; the caller builds a new group.
    """
    outcome: dict[str, object] = {}

    def construct() -> None:
        try:
            outcome["transport"] = make()
        except BaseException as exc:  # handed to the joining thread, raised there
            outcome["error"] = exc

    builder = threading.Thread(target=construct, name=f"form-sync-rank-{rank}", daemon=True)
    store.add(f"forming/{rank}", 1)
    builder.start()
    deadline = time.monotonic() + timeout_s
    while builder.is_alive() and time.monotonic() < deadline:
        _one_beat(store, rank, builder)
    if "transport" in outcome:
        return outcome["transport"]
    error = outcome.get("error")
    if isinstance(error, Exception) and not isinstance(error, (RuntimeError, dist.DistError)):
        raise error  # a fault in the caller's code, not a missing peer
    absent = absent_from_formation(store, rank, world_size, builder)
    if "transport" in outcome:  # formed while the others were watched: late, but whole
        return outcome["transport"]
    if error is None:
        raise WeightSyncError(
            f"{rank_name(rank)}: {what} (world size {world_size}) did not form within "
            f"{timeout_s:g} s: "
            + (absent or "every rank is still forming it, so the setup itself hung")
        )
    raise WeightSyncError(
        f"{rank_name(rank)} could not form {what} (world size {world_size})"
        + (f", as {absent}" if absent else "")
        + f": {error}"
    ) from error


def absent_from_formation(store, rank: int, world_size: int, builder: threading.Thread) -> str:
    """After `rank`'s formation failed or ran out of time: which other ranks are absent from it,
    in words ("" when none). This rank counts on for `ABSENCE_WATCH_S` (so that the others,
    watching at about the same time, do not name it) and reads the others' `forming/` counts
    halfway and at the end: a count of 0 never began; one that did not move in the second half
    stopped (it died, or failed and stopped watching earlier than this rank)."""
    others = [r for r in range(world_size) if r != rank]
    if not others:
        return ""
    counts = []
    for _ in range(2):
        until = time.monotonic() + ABSENCE_WATCH_S / 2
        while time.monotonic() < until:
            _one_beat(store, rank, builder)
        counts.append({r: store.add(f"forming/{r}", 0) for r in others})
    halfway, end = counts
    never = [r for r in others if end[r] == 0]
    stopped = [r for r in others if 0 < end[r] == halfway[r]]
    absent = []
    if never:
        absent.append(
            f"{describe_ranks(never)} wrote its join key but never began forming it (it died "
            "or stalled after joining)"
        )
    if stopped:
        absent.append(f"{describe_ranks(stopped)} stopped while forming it (it died or failed)")
    return "; ".join(absent)


def _one_beat(store, rank: int, builder: threading.Thread) -> None:
    """Wait one beat (less if the builder ends meanwhile), then count up `forming/<rank>`."""
    if builder.is_alive():
        builder.join(FORMING_BEAT_S)
    else:
        time.sleep(FORMING_BEAT_S)
    store.add(f"forming/{rank}", 1)


def another_connection(store):
    """A second client of the `TCPStore` `store` (the same store for any other kind, an
    in-memory one whose waits do not hold up other requests)."""
    if not isinstance(store, dist.TCPStore):
        return store
    return dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)


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
