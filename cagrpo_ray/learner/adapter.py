"""The learner's LoRA adapter: wrapping the policy, naming the adapter's tensors, and the
base policy (the adapter switched off) as the KL reference.

Under LoRA the trained policy is pi(W + (alpha / r) B A) with the base W frozen in the model's
dtype and the adapter (A: [r, in], B: [out, r] per targeted linear layer) trained in float32:
DeepSpeed optimises only parameters with requires_grad, so the base gets no gradient and no
optimizer state, and the adapter's weights, gradients and Adam moments are float32. The
names and layout of what is synced and exported are `policies/lora.py`'s contract (PEFT's
saved adapter), so the learner, the generators and `PeftModel.from_pretrained` agree.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cagrpo_ray.policies.lora import ADAPTER_NAME, LoraSpec


def with_adapter(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """`model` (a Hugging Face causal LM) wrapped by PEFT with the adapter `spec` describes:
    every base parameter frozen in its dtype, the adapter's parameters float32 and trainable.
    B starts at 0 (PEFT's initialisation), so the wrapped policy starts as the base."""
    import peft

    model.requires_grad_(False)
    wrapped = peft.get_peft_model(model, spec.peft_config(), adapter_name=ADAPTER_NAME)
    for name, param in wrapped.named_parameters():
        if param.requires_grad != _is_adapter(name):
            raise RuntimeError(
                f"LoRA wrapping left {name} with requires_grad={param.requires_grad}"
            )
        if param.requires_grad:
            param.data = param.data.float()
    return wrapped


def _is_adapter(name: str) -> bool:
    return "lora_" in name


def adapter_names(wrapped: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(saved name, live parameter) of each adapter tensor, in the model's parameter order:
    the names `peft.get_peft_model_state_dict` gives (e.g.
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), found by asking it to
    name the live parameters, so the two cannot drift apart."""
    from peft import get_peft_model_state_dict

    live = {name: param for name, param in wrapped.named_parameters() if param.requires_grad}
    saved = get_peft_model_state_dict(
        wrapped, state_dict=live, adapter_name=ADAPTER_NAME, save_embedding_layers=False
    )
    name_of = {id(param): name for name, param in saved.items()}
    if len(name_of) != len(live):
        raise RuntimeError(
            f"PEFT names {len(name_of)} of the {len(live)} trainable adapter tensors; a target "
            "module PEFT saves differently (an embedding, a modules_to_save) is not supported"
        )
    return [(name_of[id(param)], param) for param in live.values()]


class BasePolicy:
    """The policy engine with its adapter switched off: the base model, the KL reference under
    LoRA without a second copy of the weights (the starting policy, since B starts at 0).
    Called like the engine, under no_grad (the reference is never differentiated)."""

    def __init__(self, engine, wrapped: torch.nn.Module) -> None:
        self.engine, self.wrapped = engine, wrapped

    @torch.no_grad()
    def __call__(self, **inputs):
        with self.wrapped.disable_adapter():
            return self.engine(**inputs)


def save_adapter(
    out_dir: str | Path, spec: LoraSpec, base_path: str, tensors: dict[str, torch.Tensor]
) -> Path:
    """Write the adapter in PEFT's format: `adapter_config.json` and
    `adapter_model.safetensors` holding `tensors` (saved names, float32), which
    `PeftModel.from_pretrained(<the base at base_path>, out_dir)` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = spec.peft_config()
    config.base_model_name_or_path = str(base_path)
    config.save_pretrained(str(out))
    save_file(
        {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def merged_policy(base_path: str, dtype: torch.dtype, spec: LoraSpec, tensors: dict):
    """The base at `base_path` (loaded in `dtype`, the learner's base) with the adapter
    `tensors` merged in float32, W' = W + (alpha / r) B A, then cast to `dtype`: a plain
    Hugging Face model, no PEFT modules."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype).float()
    wrapped = get_peft_model(base, spec.peft_config(), adapter_name=ADAPTER_NAME)
    result = set_peft_model_state_dict(wrapped, {k: t.float() for k, t in tensors.items()})
    missing = [k for k in result.missing_keys if _is_adapter(k)]
    if result.unexpected_keys or missing:
        raise RuntimeError(
            f"the adapter does not fit the policy at {base_path}: tensors without a place "
            f"{result.unexpected_keys}, places without a tensor {missing}"
        )
    return wrapped.merge_and_unload().to(dtype)
