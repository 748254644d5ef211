"""Weight sync: buckets, the named rendezvous, and a real sync into a live vLLM engine.

The integration tests run a learner in its own process (with its own default
`torch.distributed` group, as DeepSpeed's learner has) holding the seed-1 policy, and two
generators built on the seed-0 policy: a vLLM engine (its worker is rank 1) and an HF engine
(rank 2). After a sync both hold the learner's weights bit for bit and generate as the seed-1
policy does.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import cagrpo_ray.sync.group as sync_group
from cagrpo_ray.rollout.worker_extension import MODEL_UNUSABLE
from cagrpo_ray.sync import SyncAddress, WeightReceiver, WeightSender, WeightSyncError
from cagrpo_ray.sync.buckets import group_into_buckets, pack_bucket, plan_bucket, unpack_bucket
from cagrpo_ray.sync.receiver import BufferPool
from cagrpo_ray.sync.transport import GlooTransport, NcclWork

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

SHORT_TIMEOUT_S = 2.0


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("w", torch.randn(300, 200, generator=g)),
        ("half", torch.randn(17, 3, generator=g).to(torch.bfloat16)),
        ("ids", torch.arange(11)),
        ("mask", torch.rand(5, generator=g) > 0.5),
        ("empty", torch.empty(0, 4)),
        ("transposed", torch.randn(8, 6, generator=g).t()),
        ("big", torch.randn(1000, 300, generator=g)),
    ]


# ------------------------------------------------------------------ buckets (no processes)


@pytest.mark.unit
def test_buckets_round_trip_every_dtype_bit_for_bit():
    tensors = mixed_tensors()
    buckets = list(group_into_buckets(iter(tensors), bucket_bytes=64 * 1024))
    assert len(buckets) > 2
    assert ["big"] in [[name for name, _ in b] for b in buckets], "big travels alone"
    plans = [plan_bucket(bucket, version=3, index=i) for i, bucket in enumerate(buckets)]
    received = []
    for index, plan in enumerate(plans):
        next_nbytes = plans[index + 1].nbytes if index + 1 < len(plans) else 0
        buffer = torch.empty(plan.nbytes, dtype=torch.uint8)
        pack_bucket(plan, next_nbytes, buffer)
        header, announced, views = unpack_bucket(buffer)
        assert (header.version, header.index, announced) == (3, index, next_nbytes)
        received += views
    assert [name for name, _ in received] == [name for name, _ in tensors]
    for (_, sent), (_, got) in zip(tensors, received, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert digest(got) == digest(sent)


@pytest.mark.unit
def test_no_tensors_is_one_empty_bucket():
    assert list(group_into_buckets(iter([]), bucket_bytes=1024)) == [[]]


@pytest.mark.unit
def test_receive_buffers_are_reused_only_when_no_view_is_held():
    pool = BufferPool(torch.device("cpu"), keep=1)
    first = pool.take(1000)
    held = first[64:128].view(torch.float32)  # a loader keeping a tensor of the bucket
    del first
    second = pool.take(1000)
    assert second.data_ptr() != held.data_ptr() - 64, "a viewed buffer must not be reused"
    del held
    third = pool.take(500)
    assert len(pool._buffers) == 2 and third.data_ptr() in {b.data_ptr() for b, _ in pool._buffers}
    del second, third
    pool.trim()
    assert [b.numel() for b, _ in pool._buffers] == [1000]


# ------------------------------------------------------------ transports (no second rank)


def _join_alone(backend: str, *device_args):
    """Join a one-rank group on an in-memory store; `device_args`: (device_id, device)."""
    return sync_group.join_group(
        dist.HashStore(), 0, 1, backend, SHORT_TIMEOUT_S, "127.0.0.1", *device_args,
        secret=sync_group.new_secret(),
    )  # fmt: skip


@pytest.mark.unit
def test_nccl_joins_through_pynccl_and_gloo_through_a_gloo_group(monkeypatch):
    made = []

    class FakePyNccl:  # vLLM's PyNccl needs a GPU; here only the choice is under test
        def __init__(self, store, rank, world_size, device):
            made.append((rank, world_size, device))

    monkeypatch.setattr(sync_group, "PyNcclTransport", FakePyNccl)
    gpu = torch.device("cuda", 0)
    nccl = _join_alone("nccl", "GPU-a", gpu)
    assert isinstance(nccl, FakePyNccl) and made == [(0, 1, gpu)]
    gloo = _join_alone("gloo")
    assert isinstance(gloo, GlooTransport) and isinstance(gloo.group, dist.ProcessGroupGloo)
    gloo.close()


@pytest.mark.unit
def test_an_nccl_communicator_that_fails_to_form_is_a_weight_sync_error(monkeypatch):
    def failing(store, rank, world_size, device):
        raise RuntimeError("NCCL error: remote process exited or there was a network error")

    monkeypatch.setattr(sync_group, "PyNcclTransport", failing)
    with pytest.raises(WeightSyncError, match=r"learner \(rank 0\) could not form .* NCCL"):
        _join_alone("nccl", "GPU-a", torch.device("cuda", 0))


def _member_that_joins_then_exits(address: SyncAddress, rank: int) -> None:
    """A generator worker that comes to the rendezvous (its proof, its device, its join key)
    and then ends, as one that dies right after joining: it never forms the transport."""
    store = sync_group.open_store(address.host, address.port, address.world_size,
                                  is_master=False, timeout_s=address.timeout_s)  # fmt: skip
    sync_group.present_proof(store, rank, address.secret, address.timeout_s, "test")
    store.set(f"device/{rank}", "cpu")
    store.set(f"joined/{rank}", "1")


@pytest.mark.unit
def test_a_worker_that_dies_after_writing_its_join_key_is_named_on_time():
    """gloo on loopback: the learner and worker rank 2 form the group; rank 1 wrote its join
    key and exited. Both are told, within the timeout and the watch, which rank is absent."""
    sender = WeightSender(world_size=3, timeout_s=SHORT_TIMEOUT_S)
    start = time.monotonic()
    _in_thread(_member_that_joins_then_exits, sender.address, 1).result(timeout=30)
    worker = _in_thread(WeightReceiver, sender.address, 2)
    absent = "generator worker rank 1 wrote its join key but never began forming it"
    with pytest.raises(WeightSyncError, match=absent) as error:
        sender.wait_joined()
    assert "gloo group" in str(error.value)
    with pytest.raises(WeightSyncError, match=absent):
        worker.result(timeout=30)
    bound_s = SHORT_TIMEOUT_S + sync_group.ABSENCE_WATCH_S
    assert bound_s <= time.monotonic() - start < bound_s + 10
    sender.close()


class _HangingCommunicator:
    """vLLM's PyNccl stand-in: rank `dies` fails after `after_s` (as a process that dies inside
    `ncclCommInitRank`: it stops counting), every other rank blocks as `ncclCommInitRank` does
    until `release` is set. `dies=None`: every rank blocks."""

    def __init__(self, dies: int | None, after_s: float = 0.2):
        self.dies, self.after_s = dies, after_s
        self.release = threading.Event()

    def __call__(self, store, rank, world_size, device):
        if rank == self.dies:
            time.sleep(self.after_s)
            raise RuntimeError("NCCL error: remote process exited or there was a network error")
        self.release.wait()
        raise RuntimeError("released at the end of the test")


def _join_nccl_pair(monkeypatch, communicator: _HangingCommunicator):
    """Learner rank 0 and worker rank 1 join an NCCL group (on CPU devices with distinct
    device ids) whose communicator is `communicator`; their futures."""
    monkeypatch.setattr(sync_group, "PyNcclTransport", communicator)
    secret = sync_group.new_secret()
    master = sync_group.open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=SHORT_TIMEOUT_S)
    client = sync_group.open_store("127.0.0.1", master.port, 2, is_master=False,
                                   timeout_s=SHORT_TIMEOUT_S)  # fmt: skip
    join = functools.partial(sync_group.join_group, world_size=2, backend="nccl",
                             timeout_s=SHORT_TIMEOUT_S, host="127.0.0.1",
                             device=torch.device("cpu"), secret=secret)  # fmt: skip
    return [
        _in_thread(functools.partial(join, store, rank, device_id=f"GPU-{rank}"))
        for rank, store in ((0, master), (1, client))
    ]


@pytest.mark.unit
def test_an_nccl_setup_that_hangs_names_the_rank_that_died_in_it(monkeypatch):
    communicator = _HangingCommunicator(dies=1)
    learner, worker = _join_nccl_pair(monkeypatch, communicator)
    start = time.monotonic()
    try:
        with pytest.raises(WeightSyncError) as error:
            learner.result(timeout=60)
        elapsed = time.monotonic() - start
        assert re.search(
            r"learner \(rank 0\): the weight-sync NCCL communicator on cpu \(world size 2\) did "
            r"not form within 2 s: generator worker rank 1 stopped while forming it",
            str(error.value),
        ), error.value
        bound_s = SHORT_TIMEOUT_S + sync_group.ABSENCE_WATCH_S
        assert bound_s <= elapsed < bound_s + 10
        # The rank that failed says why, and does not blame the learner, which was still there.
        with pytest.raises(WeightSyncError) as failed:
            worker.result(timeout=30)
        assert str(failed.value).startswith(
            "generator worker rank 1 could not form the weight-sync NCCL communicator on cpu "
            "(world size 2): NCCL error"
        ), failed.value
    finally:
        communicator.release.set()


@pytest.mark.unit
def test_an_nccl_setup_that_hangs_with_every_rank_in_it_says_so(monkeypatch):
    communicator = _HangingCommunicator(dies=None)
    futures = _join_nccl_pair(monkeypatch, communicator)
    try:
        for joined in futures:
            with pytest.raises(WeightSyncError, match="every rank is still forming it, so the "
                               "setup itself hung"):  # fmt: skip
                joined.result(timeout=60)
    finally:
        communicator.release.set()


class _Event:
    """A CUDA event's stand-in: done after `polls` queries (never, with None)."""

    def __init__(self, polls: int | None):
        self.polls = polls

    def query(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0


@pytest.mark.unit
def test_an_nccl_broadcast_that_never_finishes_fails_its_wait_on_time():
    NcclWork(_Event(polls=3), torch.zeros(1)).wait(timedelta(seconds=5))  # done: returns
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="not done after 0.2 s"):
        NcclWork(_Event(polls=None), torch.zeros(1)).wait(timedelta(seconds=0.2))
    assert 0.2 <= time.monotonic() - start < 2


@pytest.mark.unit
def test_the_gloo_path_never_imports_vllm():
    code = (
        "import sys, torch.distributed as dist\n"
        "from cagrpo_ray.sync.group import join_group, new_secret\n"
        "secret = new_secret()\n"
        "group = join_group(dist.HashStore(), 0, 1, 'gloo', 2.0, '127.0.0.1', secret=secret)\n"
        "group.close()\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'vllm']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------- sender and receivers (threads, processes)


def _receiver_process(address: SyncAddress, rank: int, versions: list[int], results):
    receiver = WeightReceiver(address, rank)
    for version in versions:
        digests = {}

        def load(tensors, digests=digests):
            digests.update((name, digest(tensor)) for name, tensor in tensors)

        receiver.receive(version, load)
        results.put((rank, version, digests))


@pytest.mark.integration
def test_sender_reaches_receiver_processes_bit_for_bit_beside_a_default_group():
    import torch.distributed as dist

    # The learner's own default group (DeepSpeed's) must not be touched by the sync group.
    # Learner tests keep one default group for the whole test session; reuse it when present.
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    try:
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        with WeightSender(world_size=3, timeout_s=60, bucket_mb=0.25) as sender:
            workers = [
                ctx.Process(target=_receiver_process, args=(sender.address, r, [1, 2], results))
                for r in (1, 2)
            ]
            for w in workers:
                w.start()
            sender.wait_joined()
            tensors = mixed_tensors()
            for version in (1, 2):
                stats = sender.send(iter(tensors), version)
                assert stats.version == version and stats.num_tensors == len(tensors)
                assert stats.num_buckets > 1
                assert stats.num_bytes == sum(t.numel() * t.element_size() for _, t in tensors)
            expected = {name: digest(t) for name, t in tensors}
            got = [results.get(timeout=60) for _ in range(4)]
            for w in workers:
                w.join(timeout=60)
        assert sorted((rank, version) for rank, version, _ in got) == [
            (1, 1),
            (1, 2),
            (2, 1),
            (2, 2),
        ]
        assert all(digests == expected for _, _, digests in got)
        assert dist.get_world_size() == 1  # the default group is still there, untouched
    finally:
        if created:
            dist.destroy_process_group()


def _in_thread(fn, *args):
    pool = ThreadPoolExecutor(max_workers=1)
    return pool.submit(fn, *args)


@pytest.mark.unit
def test_sender_names_the_worker_that_never_joins_within_the_timeout():
    sender = WeightSender(world_size=3, timeout_s=SHORT_TIMEOUT_S)
    joined = _in_thread(WeightReceiver, sender.address, 1)  # rank 2 never comes
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as error:
        sender.send([("w", torch.zeros(3))], version=3)
    elapsed = time.monotonic() - start
    assert re.search(
        r"weight sync v3: generator worker rank 2 did not join .* within 2 s", str(error.value)
    )
    assert elapsed < SHORT_TIMEOUT_S + 5
    with pytest.raises(WeightSyncError, match="generator worker rank 2 did not join"):
        joined.result(timeout=30)  # the worker that came is told who is missing, too
    sender.close()


@pytest.mark.unit
def test_receiver_names_the_learner_that_does_not_send_and_the_group_survives():
    sender = WeightSender(world_size=2, timeout_s=SHORT_TIMEOUT_S)
    receiver_future = _in_thread(WeightReceiver, sender.address, 1)
    sender.wait_joined()
    receiver = receiver_future.result(timeout=30)
    with pytest.raises(WeightSyncError, match=r"weight sync v5: learner \(rank 0\) did not send"):
        receiver.receive(5, lambda tensors: list(tensors))
    # No collective was started, so the group still works for the next version.
    got = {}
    received = _in_thread(receiver.receive, 6, lambda ts: got.update((n, t.clone()) for n, t in ts))
    sender.send([("w", torch.arange(4.0))], version=6)
    received.result(timeout=30)
    assert torch.equal(got["w"], torch.arange(4.0))
    sender.close()


@pytest.mark.unit
def test_sender_names_the_joined_worker_that_does_not_arrive():
    sender = WeightSender(world_size=2, timeout_s=SHORT_TIMEOUT_S)
    receiver_future = _in_thread(WeightReceiver, sender.address, 1)
    sender.wait_joined()
    receiver_future.result(timeout=30)  # joined, but never calls receive
    with pytest.raises(
        WeightSyncError, match="weight sync v1: generator worker rank 1 did not arrive"
    ):
        sender.send([("w", torch.zeros(2))], version=1)
    sender.close()


@pytest.mark.unit
def test_a_load_failure_reaches_the_sender_with_the_worker_and_the_error():
    sender = WeightSender(world_size=2, timeout_s=10)
    receiver_future = _in_thread(WeightReceiver, sender.address, 1)
    sender.wait_joined()
    receiver = receiver_future.result(timeout=30)

    def load(tensors):
        for name, _ in tensors:
            raise KeyError(f"no parameter {name}")

    received = _in_thread(receiver.receive, 1, load)
    with pytest.raises(WeightSyncError, match="generator worker rank 1 failed to load: KeyError"):
        sender.send([("w", torch.zeros(2)), ("v", torch.ones(3))], version=1)
    with pytest.raises(KeyError):
        received.result(timeout=30)
    sender.close()


@pytest.mark.unit
def test_two_ranks_on_one_gpu_are_refused_on_both_sides_before_any_collective():
    """NCCL's "Duplicate GPU detected" would come at the first broadcast; the rendezvous names
    the ranks and the GPU instead (device ids given here, as a GPU's UUID would be)."""
    sender = WeightSender(world_size=3, timeout_s=10, device_id="GPU-aaaa")
    first = _in_thread(WeightReceiver, sender.address, 1, "GPU-bbbb")
    second = _in_thread(WeightReceiver, sender.address, 2, "GPU-aaaa")
    message = r"learner \(rank 0\), generator worker ranks 2 .* same GPU GPU-aaaa"
    with pytest.raises(WeightSyncError, match=message):
        sender.wait_joined()
    for joined in (first, second):
        with pytest.raises(WeightSyncError, match="same GPU GPU-aaaa"):
            joined.result(timeout=30)
    sender.close()


@pytest.mark.unit
def test_a_worker_that_stalls_mid_transfer_fails_the_sync_and_a_new_group_works():
    tensors = [(f"w{i}", torch.full((64, 64), float(i))) for i in range(12)]  # 16 KiB each

    def run(stall_s: float):
        sender = WeightSender(world_size=2, timeout_s=SHORT_TIMEOUT_S, bucket_mb=16 / 1024)
        receiver_future = _in_thread(WeightReceiver, sender.address, 1)
        sender.wait_joined()
        receiver = receiver_future.result(timeout=30)
        got = {}
        wait = receiver._wait

        def stalling_wait(work, what):
            if "bucket 1 " in what:
                time.sleep(stall_s)  # e.g. a worker paused by the OS
            wait(work, what)

        def load(tensors):
            got.update((name, tensor.clone()) for name, tensor in tensors)

        receiver._wait = stalling_wait
        received = _in_thread(receiver.receive, 7, load)
        return sender, received, got

    sender, received, _ = run(stall_s=3 * SHORT_TIMEOUT_S)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="mid-transfer"):
        sender.send(iter(tensors), version=7)
    assert time.monotonic() - start < 2 * SHORT_TIMEOUT_S + 5  # bounded: never hangs
    with pytest.raises(WeightSyncError):
        received.result(timeout=30)  # the worker is told too, once it looks again
    with pytest.raises(WeightSyncError, match="unusable"):
        sender.send(iter(tensors), version=8)  # the aborted group is not reused
    sender.close()
    sender, received, got = run(stall_s=0.0)  # a rebuilt group carries the weights
    sender.send(iter(tensors), version=7)
    received.result(timeout=30)
    assert all(torch.equal(got[name], t) for name, t in tensors)
    sender.close()


@pytest.mark.unit
@pytest.mark.parametrize("failure", ["learner stops after 2 of 6 buckets", "end of send fails"])
def test_a_sync_that_fails_mid_transfer_leaves_the_model_as_it_was(failure):
    """The receiver stages the whole version and loads it only once the learner confirms its
    send: a failure anywhere before leaves every parameter bit for bit as it was, and is a
    plain sync error (the model stays usable; its replica keeps serving)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64, bias=False) for _ in range(6)))
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    new = [(name, torch.randn(64, 64, generator=g)) for name in before]  # 16 KiB each
    sender = WeightSender(world_size=2, timeout_s=SHORT_TIMEOUT_S, bucket_mb=16 / 1024)
    receiver_future = _in_thread(WeightReceiver, sender.address, 1)
    sender.wait_joined()
    receiver = receiver_future.result(timeout=30)
    waited, wait = [], receiver._wait

    def recording_wait(work, what):
        wait(work, what)
        waited.append(what)  # only the waits that completed: the buckets that arrived

    receiver._wait = recording_wait
    state = model.state_dict()

    @torch.no_grad()
    def load(tensors):  # a loader that changes each layer as soon as its tensor is given
        for name, tensor in tensors:
            state[name].copy_(tensor)

    received = _in_thread(receiver.receive, 1, load)
    if failure == "end of send fails":
        broadcast = sender._broadcast

        def broadcast_then_fail(*args):
            broadcast(*args)  # every bucket reaches the receiver ...
            raise WeightSyncError("the last broadcast failed on another worker")  # ... then

        sender._broadcast = broadcast_then_fail
        with pytest.raises(WeightSyncError, match="another worker"):
            sender.send(iter(new), version=1)
        arrived, message = 6, "learner's send failed after .* received every bucket"
    else:

        def stopping():  # the learner's tensors stop coming (a ZeRO-3 gather that failed)
            yield from new[:4]  # consumed a bucket ahead (and one tensor): 0 and 1 are sent
            raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            sender.send(stopping(), version=1)
        arrived, message = 2, "mid-transfer"
    with pytest.raises(WeightSyncError, match=message) as error:
        received.result(timeout=30)
    assert MODEL_UNUSABLE not in str(error.value)
    assert sum(bool(re.search(r": bucket \d", what)) for what in waited) == arrived, waited
    assert all(torch.equal(model.state_dict()[name], t) for name, t in before.items())
    sender.close()


@pytest.mark.unit
def test_a_worker_without_a_learner_store_says_so():
    address = SyncAddress(
        "127.0.0.1", free_port(), 2, "gloo", SHORT_TIMEOUT_S, sync_group.new_secret()
    )
    with pytest.raises(WeightSyncError, match="store at 127.0.0.1:.* was not reachable"):
        WeightReceiver(address, 1)


# ------------------------------------------------------------- a live vLLM engine (integration)


def _learner_main(commands, replies):
    """A learner rank 0: own default group, a policy in memory, a WeightSender."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    assert commands.get()[0] == "open"  # once the generators are up: joining is timed
    sender = WeightSender(world_size=3, timeout_s=10.0, bucket_mb=2.0)
    replies.put(("address", sender.address))
    while (command := commands.get())[0] != "stop":
        _, version, policy_dir = command
        model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
        try:
            stats = sender.send(model.named_parameters(), version)
            replies.put(("sent", stats, {n: digest(p) for n, p in model.named_parameters()}))
        except WeightSyncError as exc:
            replies.put(("error", str(exc)))
    sender.close()
    dist.destroy_process_group()


def expected_vllm_digest(hf_state: dict[str, torch.Tensor], vllm_name: str) -> str:
    """The digest a vLLM parameter must have, from the HF tensors it is fused from."""
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for vllm_part, hf_parts in fused.items():
        if f".{vllm_part}." in vllm_name:
            parts = [hf_state[vllm_name.replace(vllm_part, part)] for part in hf_parts]
            return digest(torch.cat(parts))
    return digest(hf_state[vllm_name])


@pytest.fixture(scope="module")
def policy_dirs(random_policies):
    return random_policies  # tests/conftest.py: seeds 0 and 1


@pytest.fixture(scope="module")
def generators(learner_process, policy_dirs, shared_engine):
    """The session's eager vLLM engine on the seed-0 policy (tests/conftest.py), which this
    module joins to a sync group for good and so retires at its end, and an HF engine."""
    from cagrpo_ray.rollout.engines import make_engine

    vllm_engine = shared_engine.get()
    assert vllm_engine.model_path == str(policy_dirs[0]) and vllm_engine.policy_version == 0
    hf_engine = make_engine("hf", policy_dirs[0], seed=0, max_model_len=256)
    yield vllm_engine, hf_engine
    shared_engine.retire()


@pytest.fixture(scope="module")
def learner(learner_process, generators):
    commands, replies = learner_process
    commands.put(("open",))
    kind, address = replies.get(timeout=120)
    assert kind == "address"
    vllm_engine, hf_engine = generators
    with ThreadPoolExecutor(max_workers=2) as pool:
        ranks = [
            pool.submit(vllm_engine.init_weight_sync, address, 1),
            pool.submit(hf_engine.init_weight_sync, address, 2),
        ]
        assert [r.result(timeout=120) for r in ranks] == [[1], [2]]
    return commands, replies


def sync(learner, generators, version: int, policy_dir, record_digests=True):
    commands, replies = learner
    vllm_engine, hf_engine = generators
    with ThreadPoolExecutor(max_workers=2) as pool:
        v = pool.submit(vllm_engine.receive_weights, version, record_digests)
        h = pool.submit(hf_engine.receive_weights, version)
        commands.put(("send", version, str(policy_dir)))
        reply = replies.get(timeout=120)
        return reply, v.result(timeout=120), h.result(timeout=120)


@pytest.fixture(scope="module")
def prompts(policy_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dirs[0])
    return [tokenizer(q).input_ids for q in ("<|user|>12+34=<|assistant|>", "hello", "x y")]


@pytest.mark.integration
def test_sync_makes_every_generator_the_learners_policy(learner, generators, policy_dirs, prompts):
    from transformers import AutoModelForCausalLM

    from cagrpo_ray.rollout.engines import make_engine
    from cagrpo_ray.types import SamplingConfig

    vllm_engine, hf_engine = generators
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=24)
    before = [g[0].token_ids for g in vllm_engine.generate(prompts, greedy)]

    (kind, stats, sent), vllm_stats, hf_stats = sync(learner, generators, 1, policy_dirs[1])
    assert kind == "sent", stats
    assert stats.version == 1 and stats.num_tensors == len(sent)

    # Bit for bit, every tensor as the vLLM worker received it ...
    assert vllm_stats["digests"] == [sent]
    # ... every parameter vLLM keeps as a tensor, checked against the learner's ...
    learner_state = AutoModelForCausalLM.from_pretrained(policy_dirs[1], dtype=torch.float32)
    learner_state = learner_state.state_dict()
    (kept,) = vllm_engine.parameter_digests()
    assert kept, "vLLM keeps at least the embedding and the norms as tensors"
    assert kept == {name: expected_vllm_digest(learner_state, name) for name in kept}
    # ... and every parameter of the HF generator.
    for name, tensor in hf_engine.model.state_dict().items():
        assert torch.equal(tensor, learner_state[name]), name

    # Generation is now the learner's policy, stamped with the new version.
    reference = make_engine("hf", policy_dirs[1], max_model_len=256).generate(prompts, greedy)
    for engine in (vllm_engine, hf_engine):
        after = engine.generate(prompts, greedy)
        assert engine.policy_version == 1 and {g[0].policy_version for g in after} == {1}
        assert [g[0].token_ids for g in after] == [g[0].token_ids for g in reference]
    assert [g[0].token_ids for g in reference] != before, "the two policies must differ"
    assert vllm_stats["version"] == hf_stats["version"] == 1


@pytest.mark.integration
def test_vllm_generator_names_a_learner_that_does_not_send_then_syncs_again(
    learner, generators, policy_dirs, prompts
):
    from cagrpo_ray.rollout.engines import make_engine
    from cagrpo_ray.types import SamplingConfig

    vllm_engine, _ = generators
    calls = []
    rpc = vllm_engine.engine.collective_rpc  # vLLM's AsyncLLM

    async def spy(method, timeout=None, args=(), kwargs=None):
        calls.append((method, args))
        return await rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    vllm_engine.engine.collective_rpc = spy
    start = time.monotonic()
    try:
        with pytest.raises(
            WeightSyncError, match=r"weight sync v9: learner \(rank 0\) did not send"
        ):
            vllm_engine.receive_weights(9)
    finally:
        vllm_engine.engine.collective_rpc = rpc
    assert time.monotonic() - start < 10.0 + 10
    # Only control values cross the RPC; the weights travel through the sync group.
    assert calls == [("receive_weights", (9, False))]
    # The failed rendezvous left the group usable: sync back to the seed-0 policy.
    (kind, *_), _, _ = sync(learner, generators, 2, policy_dirs[0], record_digests=False)
    assert kind == "sent"
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=24)
    reference = make_engine("hf", policy_dirs[0], max_model_len=256).generate(prompts, greedy)
    after = vllm_engine.generate(prompts, greedy)
    assert [g[0].token_ids for g in after] == [g[0].token_ids for g in reference]
    assert vllm_engine.policy_version == 2
