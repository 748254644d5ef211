"""The planner under LoRA (`plan/memory.py`): the adapter's parameter count is PEFT's, the
frozen base keeps only its weights, the generators add their adapter slots, the 7B LoRA
recipe fits on fewer GPUs than the full-parameter one, and the learner's estimate against its
measured peak on the CPU.

Measured on 2026-12-05 as test_plan_memory.py measures (MiB; one float32 rank, ZeRO-0, rank-8
adapter on every projection, 8 rows per micro-batch, every response to the last column):

    model        checkpointing  width  measured  estimated  kept for backward (estimated)
    10M (h320)   no             128      228.0      241.8    183.0 (193.3)
    10M (h320)   yes            128       62.7       91.8     10.4 (11.9)
    50M (h640)   yes            128      257.0      311.2     25.4 (28.1)

The checkpointed estimates are high because they count one recomputed layer's whole working
set, which the frozen base's backward (no weight gradients) does not reach; under full
fine-tuning the optimizer step's transients are the larger phase and hide it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from cagrpo_ray.config import load_config
from cagrpo_ray.config.sections import LoraConfig
from cagrpo_ray.plan import ClusterShape, plan
from cagrpo_ray.plan.memory import (
    DTYPE_BYTES,
    activation_bytes,
    generator_memory,
    layer_activation_bytes,
    learner_memory,
    lora_activation_bytes,
    lora_parameters,
)
from cagrpo_ray.plan.shapes import model_shape
from cagrpo_ray.policies.lora import LoraSpec
from cagrpo_ray.policies.model import random_policy

unit = pytest.mark.unit

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LORA_7B = str(CONFIGS / "gpu-7b-lora.yaml")
FULL_7B = str(CONFIGS / "gpu-7b-multinode.yaml")


def components(estimate) -> dict[str, int]:
    return {c.name: c.bytes for c in estimate.components}


@unit
@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["down_proj", "k_proj"]])
def test_the_adapter_parameter_count_is_peft_s(tmp_path, targets):
    """The planner's T against the trainable parameters PEFT creates on a Qwen2 folder with
    grouped-query attention (2 KV heads of 4) and an MLP of another width."""
    import peft

    config = Qwen2Config(
        vocab_size=50,
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "policy")
    lora = LoraConfig(rank=4, **({"target_modules": targets} if targets else {}))
    model = peft.get_peft_model(Qwen2ForCausalLM(config), LoraSpec.from_config(lora).peft_config())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(model_shape(str(tmp_path / "policy")), lora) == trainable


@unit
def test_an_unknown_target_names_the_key_and_the_known_layers():
    shape = model_shape("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
    with pytest.raises(ValueError, match="model.lora.target_modules.*qkv.*allowed: q_proj"):
        lora_parameters(shape, LoraConfig(rank=8, target_modules=["qkv"]))


@unit
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_the_frozen_base_keeps_its_weights_and_the_adapter_trains_in_float32(zero_stage):
    overrides = [f"learner.zero_stage={zero_stage}", "algorithm.kl_coef=0.01"]
    lora_config = load_config(LORA_7B, overrides)
    full_config = load_config(LORA_7B, [*overrides, "model.lora.rank=0"])
    shape = model_shape(lora_config.model.path)
    t, n = lora_parameters(shape, lora_config.model.lora), lora_config.learner.num_learners
    lora, full = (
        components(learner_memory(lora_config, shape)),
        components(learner_memory(full_config, shape)),
    )
    assert lora["weights"] == full["weights"]  # the base, in bfloat16
    assert lora["adapter"] == 4 * t
    assert lora["gradients"] == (4 * t if zero_stage == 0 else int(4 * t / n))
    expected_optimizer = (
        8 * t if zero_stage == 0 else int((0 if zero_stage == 3 else 4 * t / n) + 8 * t / n)
    )
    assert lora["optimizer"] == expected_optimizer
    assert "reference" in full and "reference" not in lora  # the base with the adapter off
    assert lora["logits"] < full["logits"]  # no head gradient
    assert lora["activations"] > full["activations"]  # the adapters' float32 inputs


@unit
def test_a_lora_generator_holds_an_adapter_slot_per_version_in_flight_and_one_more():
    config = load_config(LORA_7B, ["run.max_staleness=2"])
    shape = model_shape(config.model.path)
    lora = components(generator_memory(config, shape, 80 * 2**30))
    full = components(
        generator_memory(load_config(LORA_7B, ["model.lora.rank=0"]), shape, 80 * 2**30)
    )
    slots = 4 * DTYPE_BYTES["bfloat16"] * lora_parameters(shape, config.model.lora)
    assert lora["lora_slots"] == slots and "lora_slots" not in full
    assert lora["kv_cache"] == full["kv_cache"] - slots


@unit
def test_the_7b_lora_recipe_fits_on_fewer_gpus_than_the_full_parameter_one():
    lora_config = load_config(LORA_7B)
    cluster = ClusterShape.from_config(lora_config)
    lora_plan = plan(lora_config, cluster)
    assert lora_plan.fits, lora_plan.problems
    lora_gpus = len(lora_plan.gpus)

    full_plan = plan(
        load_config(FULL_7B), ClusterShape(nodes=2, gpus_per_node=8, gpu_memory_gib=80)
    )
    assert full_plan.fits and len(full_plan.gpus) == 16 > lora_gpus == 4
    # the full-parameter learner on the LoRA recipe's 4 GPUs: no ZeRO stage holds it
    for stage in (1, 2, 3):
        full_here = plan(
            load_config(LORA_7B, ["model.lora.rank=0", f"learner.zero_stage={stage}"]), cluster
        )
        assert not full_here.fits
        assert "learner rank" in full_here.problems[0], stage


@unit
def test_the_cpu_lora_recipe_differs_from_the_full_one_by_the_adapter_and_the_lr():
    lora = load_config(str(CONFIGS / "cpu-smollm2-lora.yaml"))
    full = load_config(str(CONFIGS / "cpu-smollm2.yaml"))
    assert lora.model.lora.rank == 8 and full.model.lora.rank == 0
    assert lora.algorithm.lr == pytest.approx(10 * full.algorithm.lr)
    same = lora.model_dump()
    other = full.model_dump()
    for tree in (same, other):
        tree["model"].pop("lora"), tree["algorithm"].pop("lr"), tree["run"].pop("name")
    assert same == other


# ----------------------------------------------------------------------------- measured


@pytest.mark.integration
@pytest.mark.beside
@pytest.mark.parametrize(("size", "checkpointing"), [("10M", False), ("10M", True), ("50M", True)])
def test_the_lora_estimate_is_safe_and_near_the_measured_peak(tmp_path, size, checkpointing):
    """In a fresh spawned process (its own process group, only its own tensors counted): the
    estimate is at least the measured peak and at most 1.5 x it, and what forward keeps for
    backward (LoRA's change included) within 15%."""
    import multiprocessing

    from test_plan_memory import LOGITS_CHUNK_MIB, SIZES, _measure_and_send

    shape_kwargs, width = SIZES[size]
    policy = str(random_policy(tmp_path / size, 0, **shape_kwargs))
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    # test_plan_memory's measurement with a rank-8 adapter: ZeRO-0, float32, 8 rows
    case = (policy, 0, checkpointing, "float32", width, LOGITS_CHUNK_MIB, 8)
    child = context.Process(target=_measure_and_send, args=(theirs, *case))
    child.start()
    theirs.close()
    assert ours.poll(600), "the measurement took over 600 s"
    status, measured = ours.recv()
    child.join()
    assert status == "ok", measured

    config = load_config(
        None,
        [
            f"model.path={policy}",
            "model.lora.rank=8",
            "learner.zero_stage=0",
            "learner.num_learners=1",
            "learner.micro_batch_size=8",
            f"learner.gradient_checkpointing={str(checkpointing).lower()}",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
            f"rollout.max_model_len={measured['width']}",
        ],
    )
    shape = model_shape(policy)
    estimate = learner_memory(config, shape, device="cpu")
    assert measured["measured"] <= estimate.total <= 1.5 * measured["measured"]
    s, tokens = 4, 8 * measured["width"]
    layer = lora_activation_bytes(shape, config.model.lora, s)
    kept = activation_bytes(shape, s, 8, measured["width"], checkpointing, layer)
    if checkpointing:  # the one layer recomputed in backward is not kept from forward
        kept -= tokens * (layer_activation_bytes(shape, s) + layer)
    assert kept == pytest.approx(measured["saved"], rel=0.15)
