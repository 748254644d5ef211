"""Only the run's own ranks join its weight-sync group.

The learner's store listens on the address the members use, not on every interface; a client
that reaches it without the group's secret is refused (a receiver with another secret at once,
a raw store client that writes a member's keys when the learner admits), and the run's own
worker still joins and receives weights.
"""

from __future__ import annotations

import dataclasses
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import cagrpo_ray.sync.group as sync_group
from cagrpo_ray.sync import WeightReceiver, WeightSender, WeightSyncError

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]

TIMEOUT_S = 3.0


def _in_thread(fn, *args):
    return ThreadPoolExecutor(max_workers=1).submit(fn, *args)


def _outward_ip() -> str:
    """This machine's address on the interface of its default route, found as Ray finds a
    node's IP (a UDP socket's connect sends nothing); loopback when it has no such route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
        except OSError:
            return "127.0.0.1"
        return s.getsockname()[0]


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_the_store_listens_only_on_the_address_the_members_use():
    ip = _outward_ip()
    if ip.startswith("127."):
        pytest.skip("this machine has no interface besides loopback to reach the store from")
    # The check can fail: torch's own master store is reachable on every interface.
    plain = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    assert _reachable(ip, plain.port)
    sender = WeightSender(host="127.0.0.1", world_size=2, timeout_s=TIMEOUT_S)
    try:
        assert _reachable("127.0.0.1", sender.port)
        assert not _reachable(ip, sender.port)
    finally:
        sender.close()


def test_the_address_holds_a_fresh_secret_that_its_repr_never_shows():
    first = WeightSender(world_size=2, timeout_s=TIMEOUT_S)
    second = WeightSender(world_size=2, timeout_s=TIMEOUT_S)
    try:
        secret = first.address.secret
        assert len(bytes.fromhex(secret)) == 32 and secret != second.address.secret
        assert secret not in repr(first.address) and "secret" not in repr(first.address)
    finally:
        first.close()
        second.close()


def test_the_single_node_store_is_on_loopback_and_a_cluster_s_on_the_learner_node():
    assert sync_group.sync_host("10.1.2.3", single_node=True) == "127.0.0.1"
    assert sync_group.sync_host("10.1.2.3", single_node=False) == "10.1.2.3"


def test_a_stranger_without_the_secret_is_refused_and_the_run_s_worker_still_joins():
    sender = WeightSender(world_size=2, timeout_s=TIMEOUT_S)
    try:
        # A receiver given another group's secret: the store's challenge does not verify.
        forged = dataclasses.replace(sender.address, secret=sync_group.new_secret())
        with pytest.raises(WeightSyncError, match="generator worker rank 1 was refused"):
            WeightReceiver(forged, 1)
        # A raw client that knows the protocol but not the secret writes rank 1's keys.
        stranger = dist.TCPStore("127.0.0.1", sender.port, 2, is_master=False)
        stranger.append("auth/member/1", "0" * 64 + ";")
        stranger.set("device/1", "cpu")
        stranger.set("joined/1", "1")
        assert not stranger.check(["auth/admitted/1"])
        # The run's own worker joins beside the stranger's entry and receives the weights.
        receiver_future = _in_thread(WeightReceiver, sender.address, 1)
        sender.wait_joined()
        receiver = receiver_future.result(timeout=30)
        got = {}
        received = _in_thread(
            receiver.receive, 1, lambda ts: got.update((n, t.clone()) for n, t in ts)
        )
        weights = torch.randn(5, 7, generator=torch.Generator().manual_seed(3))
        sender.send([("w", weights)], version=1)
        received.result(timeout=30)
        assert torch.equal(got["w"], weights)
    finally:
        sender.close()


def test_a_member_that_never_proves_the_secret_is_not_admitted():
    sender = WeightSender(world_size=2, timeout_s=TIMEOUT_S)
    try:
        stranger = dist.TCPStore(
            "127.0.0.1", sender.port, 2, is_master=False, timeout=timedelta(seconds=5)
        )
        stranger.wait(["auth/challenge"])
        challenge = stranger.get("auth/challenge").decode()
        # A well-formed proof under the wrong secret, and one copied from the learner's.
        stranger.append("auth/member/1", sync_group.proof(sync_group.new_secret(), challenge,
                                                          "member", 1) + ";")
        stranger.append("auth/member/1", stranger.get("auth/learner").decode() + ";")
        stranger.set("device/1", "cpu")
        stranger.set("joined/1", "1")
        message = r"generator worker rank 1 did not prove the group's secret within 3 s \(2 "
        with pytest.raises(WeightSyncError, match=message):
            sender.wait_joined()
        assert not stranger.check(["auth/admitted/1"])
    finally:
        sender.close()


def test_the_store_that_nccl_reads_refuses_values_without_the_secret():
    """vLLM's StatelessProcessGroup unpickles what it reads: an unsigned or foreign value
    must be refused before that."""
    secret, challenge = sync_group.new_secret(), "c0ffee"
    raw = dist.HashStore()
    signed = sync_group.SignedStore(raw, secret, challenge)
    signed.set("broadcast_from/0/0", b"\x80\x04K\x07.")  # pickle of 7
    assert signed.get("broadcast_from/0/0") == b"\x80\x04K\x07."
    raw.set("broadcast_from/0/1", b"\x80\x04K\x07.")  # a stranger's value, unsigned
    other = sync_group.SignedStore(raw, sync_group.new_secret(), challenge)
    other.set("broadcast_from/0/2", b"x")  # signed under another secret
    raw.set("moved", raw.get("broadcast_from/0/0"))  # a member's value under another key
    later = sync_group.SignedStore(raw, secret, "later-group")  # or in a later group
    for store, key in [(signed, "broadcast_from/0/1"), (signed, "broadcast_from/0/2"),
                       (signed, "moved"), (later, "broadcast_from/0/0")]:  # fmt: skip
        with pytest.raises(WeightSyncError, match=f"value at '{key}' .* refused before use"):
            store.get(key)
    assert signed.delete_key("broadcast_from/0/0") and not raw.check(["broadcast_from/0/0"])


def test_the_nccl_transport_is_built_on_the_signed_store(monkeypatch):
    made = []
    monkeypatch.setattr(
        sync_group, "PyNcclTransport", lambda store, *args: made.append(store) or object()
    )
    sync_group.join_group(
        dist.HashStore(), 0, 1, "nccl", TIMEOUT_S, "127.0.0.1", "GPU-a",
        torch.device("cuda", 0), secret=sync_group.new_secret(),
    )  # fmt: skip
    assert isinstance(made[0], sync_group.SignedStore)
