"""The learner under LoRA (`learner/adapter.py`): the loss of the policy with its adapter is the
merged model's, a step moves only the adapter, the sync and the exports hold the adapter as
PEFT names it, two ZeRO-3 ranks gather the adapter of one rank, and a resume is exact.

The policy is the tiny random Qwen2 of test_learner.py, whose attention and MLP projections
are the default LoRA targets; the float64 references merge W + (alpha / r) B A by hand.
"""

from __future__ import annotations

import deepspeed
import pytest
import torch
import torch.multiprocessing as mp
from peft import PeftModel, get_peft_model_state_dict
from test_learner import TINY, free_port, hf_logprobs, one_rank, random_batch, settings_at
from transformers import AutoModelForCausalLM

from cagrpo_ray.algo import LossSpec, policy_loss
from cagrpo_ray.config.sections import LoraConfig
from cagrpo_ray.learner.group import split_by_groups
from cagrpo_ray.learner.learner import Learner
from cagrpo_ray.policies.lora import LoraSpec, adapter_checksum
from cagrpo_ray.policies.model import random_policy
from cagrpo_ray.sync.sender import SyncStats

__all__ = ["one_rank"]  # the session's process group, shared with test_learner.py

SPEC = LoraSpec.from_config(LoraConfig(rank=4, alpha=8.0))


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    return random_policy(tmp_path_factory.mktemp("policy"), seed=0, **TINY)


def lora_learner(path, rank_args, loss: LossSpec | None = None, **settings) -> Learner:
    return Learner(
        settings_at(path, lora=SPEC, **{"lr": 1e-2, "micro_batch_size": 32, **settings}),
        loss or LossSpec("cagrpo"),
        **rank_args,
    )


def randomize_adapter(learner: Learner, seed: int) -> None:
    """Random A and B (PEFT starts B at 0, which would make the adapter a no-op), under ZeRO
    stage 0 to 2 (live, whole parameters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in learner.adapter:
            param.copy_(0.2 * torch.randn(param.shape, generator=g))


def merged_float64(path, adapter: dict[str, torch.Tensor], spec: LoraSpec = SPEC):
    """The base in float64 with W + (alpha / r) B A written into each targeted layer by hand."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    params = dict(model.named_parameters())
    merged = 0
    for name, a in adapter.items():
        if ".lora_A." in name:
            layer = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[name.replace(".lora_A.", ".lora_B.")]
            with torch.no_grad():
                params[f"{layer}.weight"] += spec.scaling * b.double() @ a.double()
            merged += 1
    assert merged == 2 * len(spec.target_modules)  # two layers, every target in each
    return model.eval()


def base_parameters(learner: Learner) -> dict[str, torch.Tensor]:
    """The base's parameters, whole (gathered under ZeRO-3)."""
    out = {}
    for name, param in learner.engine.module.named_parameters():
        if "lora_" not in name:
            with deepspeed.zero.GatheredParameters([param], enabled=learner.zero_stage == 3):
                out[name] = param.detach().clone()
    return out


# ----------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_the_loss_with_the_adapter_is_the_merged_models_and_the_reference_is_the_base(
    policy_path, one_rank
):
    """Log-probs, loss and KL of a step with a random adapter against a float64 reference:
    the merged model for the policy, the plain base for the KL reference (adapter off)."""
    batch = random_batch(seed=3)
    mask = batch["response_mask"]
    loss = LossSpec("cagrpo", kl_coef=0.1)
    learner = lora_learner(policy_path, one_rank, loss)
    randomize_adapter(learner, seed=11)
    merged = hf_logprobs(merged_float64(policy_path, learner.state_dict_for_sync()), batch)
    base = hf_logprobs(AutoModelForCausalLM.from_pretrained(policy_path).double(), batch)
    batch["behavior_logprobs"] = merged * mask
    assert (merged - base).abs()[mask].max() > 1e-2  # the adapter does change the policy

    metrics = learner.train_step(batch)

    assert metrics["logprob/mismatch_max"] < 1e-5
    expected = policy_loss(
        loss,
        merged.double() * mask,
        merged.double() * mask,
        batch["advantages"].double(),
        mask,
        batch["group_ids"],
        ref_logprobs=base.double() * mask,
    )
    assert metrics["loss/total"] == pytest.approx(float(expected.loss), rel=1e-4, abs=1e-7)
    assert metrics["kl/ref_k3"] == pytest.approx(float(expected.metrics["kl/ref_k3"]), rel=1e-4)
    assert metrics["kl/ref_k3"] > 1e-4


@pytest.mark.unit
@pytest.mark.parametrize(
    ("zero_stage", "dtype"), [(0, "float32"), (2, "bfloat16"), (3, "bfloat16")]
)
def test_a_step_moves_only_the_adapter_which_alone_the_optimizer_holds(
    policy_path, one_rank, zero_stage, dtype
):
    learner = lora_learner(policy_path, one_rank, zero_stage=zero_stage, dtype=dtype)
    adapter_ids = {id(param) for _, param in learner.adapter}
    for name, param in learner.engine.module.named_parameters():
        is_adapter = id(param) in adapter_ids
        assert param.requires_grad == is_adapter, name
        assert param.dtype == (torch.float32 if is_adapter else getattr(torch, dtype)), name
    adapter_numel = sum(param.numel() for _, param in learner.adapter)
    optimizer = learner.engine.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch AdamW
    held = [p for group in inner.param_groups for p in group["params"]]
    if zero_stage == 0:
        assert {id(p) for p in held} == adapter_ids
    else:  # one flat float32 partition of the adapter (padded for alignment)
        assert adapter_numel <= sum(p.numel() for p in held) < adapter_numel + 64
        assert all(p.dtype == torch.float32 for p in held)
    base_before = base_parameters(learner)
    adapter_before = learner.state_dict_for_sync()

    learner.train_step(random_batch(seed=1))
    learner.train_step(random_batch(seed=2))  # B != 0 now, so A has a gradient too

    for name, value in base_parameters(learner).items():
        assert torch.equal(value, base_before[name]), name
    adapter_after = learner.state_dict_for_sync()
    for name, value in adapter_after.items():
        assert not torch.equal(value, adapter_before[name]), name
    for state in inner.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


class RecordingSender:
    """Rank 0's weight sender, recording what it was handed (the receivers are sync/'s)."""

    def announce(self, version: int) -> None:
        self.announced = version

    def send(self, named_tensors, version: int) -> SyncStats:
        self.received = [(name, t.clone()) for name, t in named_tensors]
        nbytes = sum(t.numel() * t.element_size() for _, t in self.received)
        return SyncStats(version, len(self.received), nbytes, 1, 0.0)


@pytest.mark.unit
def test_the_sync_sends_the_adapter_as_peft_names_it_with_its_checksum(policy_path, one_rank):
    learner = lora_learner(policy_path, one_rank)
    randomize_adapter(learner, seed=5)
    peft_state = get_peft_model_state_dict(learner.engine.module.policy)

    synced = list(learner.iter_sync_weights())
    assert [name for name, _ in synced] == list(peft_state)
    for name, tensor in synced:
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, peft_state[name]), name

    learner.weight_sender = RecordingSender()
    stats = learner.send_weights(version=3)
    received = learner.weight_sender.received
    assert stats["num_tensors"] == len(peft_state) == len(received)
    assert stats["adapter_checksum"] == adapter_checksum(peft_state.items())
    assert stats["adapter_checksum"] == adapter_checksum(received)
    # one tensor skipped or one element changed: another checksum
    assert adapter_checksum(received[1:]) != stats["adapter_checksum"]
    received[0][1].view(-1)[0] += 1e-6
    assert adapter_checksum(received) != stats["adapter_checksum"]

    full = Learner(settings_at(policy_path, micro_batch_size=32), LossSpec("cagrpo"), **one_rank)
    full.weight_sender = RecordingSender()
    full_stats = full.send_weights(version=1)
    assert "adapter_checksum" not in full_stats  # full fine-tuning: as before
    assert full_stats["num_tensors"] == len(list(full.engine.module.policy.parameters()))
    assert stats["num_bytes"] < 0.2 * full_stats["num_bytes"]


@pytest.mark.unit
def test_exports_the_merged_policy_and_the_peft_adapter(policy_path, one_rank, tmp_path):
    learner = lora_learner(policy_path, one_rank)
    randomize_adapter(learner, seed=7)
    adapter = learner.state_dict_for_sync()
    policy_dir = learner.save_hf(tmp_path / "policy")
    adapter_dir = learner.save_adapter(tmp_path / "adapter")

    merged = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    assert not (policy_dir / "adapter_config.json").exists()
    assert (adapter_dir / "adapter_config.json").exists()
    assert (adapter_dir / "adapter_model.safetensors").exists()
    served = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(policy_path), adapter_dir
    )
    served.eval()
    loaded = get_peft_model_state_dict(served)
    assert loaded.keys() == adapter.keys()
    for name, value in adapter.items():
        assert torch.equal(loaded[name], value), name

    batch = random_batch(seed=9)
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        torch.testing.assert_close(
            merged(**inputs).logits, served(**inputs).logits, rtol=0, atol=1e-5
        )
    reference = merged_float64(policy_path, adapter)
    for name, value in merged.state_dict().items():
        expected = reference.state_dict()[name].float()
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6, msg=name)


@pytest.mark.unit
def test_save_adapter_without_lora_says_what_is_missing(policy_path, one_rank, tmp_path):
    full = Learner(settings_at(policy_path, micro_batch_size=32), LossSpec("cagrpo"), **one_rank)
    with pytest.raises(RuntimeError, match="model.lora.rank"):
        full.save_adapter(tmp_path / "adapter")


# ----------------------------------------------------------------------------- integration


@pytest.mark.integration
@pytest.mark.beside
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_resume_with_lora_repeats_the_step_from_a_checkpoint_of_the_adapter_only(
    policy_path, one_rank, tmp_path, zero_stage
):
    settings = dict(zero_stage=zero_stage, lr=1e-2, warmup_steps=3)
    loss = LossSpec("cagrpo", kl_coef=0.05)
    learner = lora_learner(policy_path, one_rank, loss, **settings)
    for seed in (1, 2):  # k = 2 steps: Adam's moments and the warm-up under way
        learner.train_step(random_batch(seed=seed))
    learner.save_checkpoint(tmp_path / "ckpt", {"data_cursor": 2})
    first = learner.train_step(random_batch(seed=3))
    first_adapter = learner.state_dict_for_sync()

    (states,) = (tmp_path / "ckpt" / "learner").glob("*model_states.pt")
    module = torch.load(states, weights_only=False)["module"]
    parameters = dict(learner.engine.module.named_parameters())
    buffers = dict(learner.engine.module.named_buffers())
    saved = [name for name in module if name in parameters]
    assert saved and all(parameters[name].requires_grad for name in saved)  # no frozen base
    # Besides the adapter: the rotary buffers, and the tied head's second name (DeepSpeed
    # drops frozen parameters by `named_parameters()`, which lists a tied weight once).
    others = {name for name in module if name not in parameters and name not in buffers}
    assert others <= {"policy.base_model.model.lm_head.weight"}

    resumed = lora_learner(policy_path, one_rank, loss, **settings)  # a fresh adapter
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"data_cursor": 2}
    assert resumed.step == 2
    second = resumed.train_step(random_batch(seed=3))
    for key in ("loss/total", "grad_norm", "kl/ref_k3", "lr"):
        assert second[key] == first[key], key
    for name, value in resumed.state_dict_for_sync().items():
        assert torch.equal(value, first_adapter[name]), name


def _two_rank_worker(rank: int, port: int, policy_path: str, out: str) -> None:
    torch.set_num_threads(1)
    learner = lora_learner(
        policy_path,
        dict(rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port),
        zero_stage=3,
        micro_batch_size=4,
    )
    shard = split_by_groups(random_batch(seed=4), 2)[rank]
    learner.train_step(shard)
    synced = list(learner.iter_sync_weights())
    learner.weight_sender = RecordingSender() if rank == 0 else None
    stats = learner.send_weights(version=1)
    if rank == 0:
        torch.save({"synced": synced, "stats": stats}, out)
    else:
        assert synced == [] and stats == {}


@pytest.mark.integration
def test_two_zero3_ranks_gather_the_adapter_of_one_rank(policy_path, one_rank, tmp_path):
    """Two processes (gloo, ZeRO-3, each half of the batch's groups) against this process as
    one rank on the whole batch: the gathered adapter, its names and its checksum."""
    out = tmp_path / "rank0.pt"
    mp.spawn(_two_rank_worker, args=(free_port(), str(policy_path), str(out)), nprocs=2, join=True)
    two = torch.load(out, weights_only=False)

    single = lora_learner(policy_path, one_rank, zero_stage=3, micro_batch_size=4)
    single.train_step(random_batch(seed=4))
    expected = dict(single.iter_sync_weights())
    synced = dict(two["synced"])
    assert synced.keys() == expected.keys()
    for name, value in synced.items():
        assert value.dtype == torch.float32, name
        # Adam moves an element by about lr * sign(g); the two ranks sum the micro-batches'
        # gradients in another order, which may change the last bits of a near-zero g.
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0.05 * 1e-2, msg=name)
    assert two["stats"]["adapter_checksum"] == adapter_checksum(two["synced"])
