"""A LoRA run end to end (real Ray, vLLM, DeepSpeed on the CPU): three synchronous steps of the
embedded default with `model.lora.rank` set. Each sync moves only the adapter (a few percent of
the model's bytes), every replica acknowledged the adapter the learner sent (the run would have
stopped otherwise), the generators' log-probs match the learner's adapter-on forward on the
version they sampled with (synchronous, so every token's; under a staleness bound the metric
also holds the policy's lag), and the run leaves the merged policy and the PEFT adapter, which
give the same logits. In-flight loads of adapters: tests/test_lora_sync.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cagrpo_ray.config import load_config
from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.policies.build import resolve_policy

pytestmark = [pytest.mark.integration, pytest.mark.preset]

STEPS = 3


def test_a_lora_run_syncs_only_the_adapter_and_exports_both_forms(shared_ray, tmp_path):
    config = load_config(
        "configs/cpu-tiny.yaml",
        [
            "model.path=chain_sum",
            "model.lora.rank=4",
            "model.lora.alpha=8",
            "algorithm.lr=2e-3",
            f"run.output_dir={tmp_path}",
            "run.name=lora",
            f"run.steps={STEPS}",
            "run.checkpoint_every=0",
            "run.save_policy=end",
            "rollout.prompts_per_step=4",
            "rollout.group_size=8",
            "rollout.enforce_eager=true",
            "rollout.num_generators=1",
            "learner.num_learners=1",
            "data.eval_size=4",
            "eval.samples=1",
            "metrics.port=0",
            "metrics.inspect_every=0",
            "metrics.inspect_port=null",
        ],
    )
    trainer = Trainer(config)
    trainer.run()
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    base = load_file(Path(resolve_policy("chain_sum")) / "model.safetensors")
    full_bytes = sum(t.numel() * t.element_size() for t in base.values())
    synced = [r["sync/bytes"] for r in records if "sync/bytes" in r]
    assert synced, "no weight sync was recorded"
    # rank 4 on every attention and MLP projection of the 1.8M-parameter policy: ~3% of it
    assert all(0 < b < 0.05 * full_bytes for b in synced), (synced, full_bytes)
    # the generators sampled with the adapter the learner trains (a stale one would differ)
    later = [r["logprob/mismatch_max"] for r in records[1:]]
    assert all(math.isfinite(m) and m < 1e-3 for m in later), later

    # both exports: the merged policy is a plain model, the adapter PEFT's; same logits
    import peft
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "policy")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(resolve_policy("chain_sum")),
        trainer.run_dir / "adapter",
    )
    ids = torch.randint(3, 17, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(resolve_policy("chain_sum"))(
            input_ids=ids
        ).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (a - plain).abs().max() > 1e-4, "the trained adapter changed nothing"
