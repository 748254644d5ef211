"""Two DeepSpeed learner ranks at ZeRO-3 send a version into gloo receivers: the real path.

`Learner.send_weights` on two ranks (gloo, ZeRO-3, after a training step so that each rank
holds its half of updated parameters): rank 0 waits for the receivers, broadcasts go to rank 1,
then gathers each parameter lazily as its `WeightSender` packs buckets, while rank 1 takes part
in every gather eagerly. Two `WeightReceiver`s (this process, threads) must receive the full
gathered parameters bit for bit, under full fine-tuning and with a LoRA adapter of rank 4 (the
adapter only). A version that the receivers never come for is a no-go: rank 0 reports it after
the sync timeout, rank 1 returns without gathering, and the next version arrives whole.
"""

from __future__ import annotations

import io
import multiprocessing
import threading

import deepspeed
import pytest
import torch
from test_learner import free_port, policy_path, random_batch, settings_at
from test_lora_learner import SPEC
from transformers import AutoModelForCausalLM

from cagrpo_ray.algo import LossSpec
from cagrpo_ray.learner.group import split_by_groups
from cagrpo_ray.learner.learner import Learner
from cagrpo_ray.sync import WeightReceiver

__all__ = ["policy_path"]  # test_learner.py's tiny random policy

pytestmark = pytest.mark.integration

RECEIVERS = 2
TIMEOUT_S = 8.0
BUCKET_MB = 16 / 1024  # 16 KiB: the tiny policy's tensors span many buckets
DEADLINE_S = 240  # for any one step of the test to come


def _gathered(learner: Learner) -> dict[str, torch.Tensor]:
    """Every tensor a sync carries, gathered at once (not one by one, as the sync gathers), as
    CPU copies: the policy's parameters, or the adapter's under LoRA."""
    named = list(learner.adapter or learner.engine.module.policy.named_parameters())
    with deepspeed.zero.GatheredParameters([param for _, param in named]):
        return {name: param.detach().to("cpu", copy=True) for name, param in named}


def _as_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The tensors serialized by value: a tensor put on a multiprocessing queue as it is travels
    as a shared-memory handle that the receiver can only open while the sender lives, and a
    rank that exits before this slow process reads the queue would lose it."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def _from_bytes(payload: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(payload), weights_only=True)


def _learner_rank(rank: int, port: int, path: str, lora: bool, replies, go_on) -> None:
    torch.set_num_threads(1)
    learner = Learner(
        settings_at(path, zero_stage=3, micro_batch_size=4, lr=1e-2, lora=SPEC if lora else None),
        LossSpec("cagrpo"),
        rank=rank,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=port,
    )
    learner.train_step(split_by_groups(random_batch(seed=4), 2)[rank])
    address = learner.open_weight_sender("127.0.0.1", 1 + RECEIVERS, "gloo", TIMEOUT_S, BUCKET_MB)
    if rank == 0:
        replies.put(("address", address))
    results = {}
    for version in (1, 2, 3):  # 2: the receivers do not come
        results[version] = learner.send_weights(version)
        if rank == 0:
            replies.put((f"sent v{version}", results[version]))
            go_on.wait()
    expected = _gathered(learner)
    replies.put((f"rank {rank}", (results, _as_bytes(expected) if rank == 0 else None)))
    if learner.weight_sender is not None:
        learner.weight_sender.close()


def _receive(receiver: WeightReceiver, version: int, into: dict) -> None:
    receiver.receive(version, lambda tensors: into.update((n, t.clone()) for n, t in tensors))


def _started(calls) -> list[threading.Thread]:
    """One started thread per `(target, args)` (the receivers wait while the ranks send)."""
    threads = [threading.Thread(target=target, args=args) for target, args in calls]
    for thread in threads:
        thread.start()
    return threads


def _joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=DEADLINE_S)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-rank-4"])
def test_two_zero3_ranks_send_their_gathered_parameters_bit_for_bit(policy_path, lora):
    ctx = multiprocessing.get_context("spawn")
    replies, go_on = ctx.Queue(), ctx.Event()
    port = free_port()
    ranks = [
        ctx.Process(target=_learner_rank, args=(r, port, str(policy_path), lora, replies, go_on))
        for r in range(2)
    ]
    for process in ranks:
        process.start()
    receivers = [None] * RECEIVERS
    try:
        kind, address = replies.get(timeout=DEADLINE_S)
        assert kind == "address", address
        received = [{} for _ in range(RECEIVERS)]

        def join_and_receive(index: int) -> None:
            receivers[index] = WeightReceiver(address, 1 + index)
            _receive(receivers[index], 1, received[index])

        threads = _started([(join_and_receive, (i,)) for i in range(RECEIVERS)])
        kind, sent_v1 = replies.get(timeout=DEADLINE_S)
        _joined(threads)
        assert kind == "sent v1" and "error" not in sent_v1, sent_v1
        first = [dict(r) for r in received]
        go_on.set()

        # v2: nobody comes; rank 0 says so after the timeout, rank 1 gathers nothing.
        kind, sent_v2 = replies.get(timeout=DEADLINE_S)
        assert kind == "sent v2", sent_v2
        assert "generator worker ranks 1, 2 did not arrive" in sent_v2["error"], sent_v2

        # v3: the group is still whole after a no-go.
        for r in received:
            r.clear()
        threads = _started([(_receive, (receivers[i], 3, received[i])) for i in range(RECEIVERS)])
        kind, sent_v3 = replies.get(timeout=DEADLINE_S)
        _joined(threads)
        assert kind == "sent v3" and "error" not in sent_v3, sent_v3

        finals = dict(replies.get(timeout=DEADLINE_S) for _ in range(2))
        rank0_results, expected = finals["rank 0"][0], _from_bytes(finals["rank 0"][1])
        rank1_results, _ = finals["rank 1"]
        assert rank1_results == {1: {}, 2: {}, 3: {}}  # rank 1 only took part in the gathers
        assert rank0_results[1] == sent_v1 and rank0_results[3] == sent_v3
    finally:
        go_on.set()
        for receiver in receivers:
            if receiver is not None:
                receiver.close()
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    assert [p.exitcode for p in ranks] == [0, 0]

    if lora:
        assert all(".lora_A." in n or ".lora_B." in n for n in expected), sorted(expected)
        assert sent_v1["adapter_checksum"] == sent_v3["adapter_checksum"]
    else:
        assert "model.embed_tokens.weight" in expected and "lm_head.weight" not in expected
    # The training step moved what is synced (the adapter's B starts at 0, the base starts as
    # saved): a sync of the initial policy would not pass.
    if lora:
        assert all(t.abs().sum() > 0 for n, t in expected.items() if ".lora_B." in n)
    else:
        initial = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
        assert any(not torch.equal(p, expected[n]) for n, p in initial.named_parameters())
    for got in first + received:
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert sent_v1["num_tensors"] == len(expected) and sent_v1["num_buckets"] > 1
    assert sent_v1["num_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
