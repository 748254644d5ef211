"""Random-init small Qwen2 causal LMs with the character-level tokenizer.

The Qwen2 architecture makes vLLM, DeepSpeed and transformers treat the policy as a real model.
Heads are 64 wide (3 heads at hidden size 192) because vLLM's CPU attention supports head sizes
32, 64, 80, 96, ... and not 48, which 4 heads at 192 would give.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from cagrpo_ray.policies.tokenizer import char_tokenizer

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclass(frozen=True)
class PolicySize:
    """Shape of a small Qwen2 policy; the defaults give 1.82 M parameters (1,823,424)."""

    hidden_size: int = 192
    num_layers: int = 3
    num_heads: int = 3  # head size hidden_size / num_heads must be one vLLM's CPU attention runs
    intermediate_size: int = 768
    max_positions: int = 1024  # longest prompt + response, in characters

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        head_size = self.hidden_size // self.num_heads
        if head_size not in VLLM_CPU_HEAD_SIZES:
            raise ValueError(
                f"head size {head_size} (hidden_size {self.hidden_size} / num_heads "
                f"{self.num_heads}) is not one of vLLM's CPU head sizes {VLLM_CPU_HEAD_SIZES}"
            )


def qwen2_config(tokenizer: PreTrainedTokenizerFast, size: PolicySize) -> Qwen2Config:
    """A Qwen2 config with tied embeddings, one output per token id of `tokenizer`."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def new_policy(seed: int = 0, size: PolicySize | None = None):
    """A random-init Qwen2ForCausalLM and its tokenizer; the weights depend on `seed` only."""
    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(qwen2_config(tokenizer, size or PolicySize()))
    return model, tokenizer


def save_policy(model, tokenizer, out_dir: str | Path) -> Path:
    """Save in the standard Hugging Face layout: config, safetensors, tokenizer, generation config.

    The generation config's eos is the tokenizer's eos, so that vLLM and `generate` stop there.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def random_policy(out_dir: str | Path, seed: int = 0, **size) -> Path:
    """Write a random-init small policy to `out_dir` and return the directory.

    `size` overrides fields of `PolicySize` (hidden_size, num_layers, num_heads,
    intermediate_size, max_positions).
    """
    model, tokenizer = new_policy(seed, PolicySize(**size))
    return save_policy(model, tokenizer, out_dir)


def parameter_count(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
