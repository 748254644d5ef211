"""Low-rank adapters (LoRA): the one description the learner and the generators share.

What travels in a weight sync under LoRA is the adapter only, as the (name, tensor) pairs of
PEFT's saved adapter (`peft.get_peft_model_state_dict`): names such as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (no adapter name inside),
float32 tensors, `lora_A` of shape (rank, in_features) and `lora_B` of (out_features, rank).
That is the layout `PeftModel.from_pretrained` reads from `adapter_model.safetensors` and
vLLM's `LoRAModel.from_lora_tensors` takes, so the sender, the receivers and the exported
adapter agree without a translation table.

`adapter_checksum` is the fingerprint a generator acknowledges a sync with: the learner
computes it over what it sent, each receiver over what it now serves, and a difference stops
the run naming the replica (a stale or partly loaded adapter is otherwise silent).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# The adapter's name inside a PeftModel (PEFT's default; absent from the saved names).
ADAPTER_NAME = "default"


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: rank r, alpha (the update is scaled by alpha / r), dropout on the
    adapter's input, and the names of the linear layers that get one."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def from_config(cls, lora) -> LoraSpec | None:
        """From `config.model.lora` (a `LoraConfig`); None when LoRA is off (rank 0)."""
        if not lora.rank:
            return None
        return cls(lora.rank, float(lora.alpha), float(lora.dropout), tuple(lora.target_modules))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self):
        """The `peft.LoraConfig` of this adapter, for a causal language model."""
        import peft

        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )


def adapter_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the adapter's tensors in name order: each name, dtype, shape and its bytes
    (row-major). Equal adapters give equal checksums on every process; one tensor missing,
    renamed, reshaped or with one bit changed gives another."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
