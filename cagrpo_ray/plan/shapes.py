"""The decoder's shape, which is all the memory estimate needs to know about a model.

`model_shape(path)` reads it without loading any weights and without a network:

- a folder: its `config.json` (Qwen2 and Llama keys);
- a built-in preset name (`cagrpo_ray.policies.build.PRESETS`): the preset's `PolicySize` and
  the character tokenizer's vocabulary, without building the preset;
- a hub id: `models.json` beside this file, which holds the recipes' hub models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODELS_FILE = Path(__file__).with_name("models.json")
# DeepSpeed ZeRO-3 keeps parameters under this many elements whole on every rank
# (`stage3_param_persistence_threshold`, default 1e5): the norms and biases.
PERSISTENCE_THRESHOLD = 100_000


class ModelShapeError(ValueError):
    """The model's shape cannot be read; the message says what to provide."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Qwen2 or Llama layout): per layer RMSNorm, attention with
    `num_kv_heads` key/value heads (grouped-query attention when fewer than `num_heads`), RMSNorm
    and a gated MLP (gate, up, down); then a final norm and the output head."""

    layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q, k and v; Llama has none
    source: str = ""  # where the numbers came from

    @property
    def attention_width(self) -> int:
        """Width of the queries (and of the attention output), num_heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values), num_kv_heads x head_dim."""
        return self.num_kv_heads * self.head_dim

    def tensor_sizes(self) -> list[int]:
        """Element count of every parameter tensor (tied embeddings once), in model order."""
        h, a, kv, i = self.hidden_size, self.attention_width, self.kv_width, self.intermediate_size
        # norm, q, k, v, o, norm, gate, up, down, then the q/k/v biases
        layer = [h, h * a, h * kv, h * kv, a * h, h, h * i, h * i, i * h]
        layer += [a, kv, kv] if self.qkv_bias else []
        head = [] if self.tied_embeddings else [self.vocab_size * h]
        return [self.vocab_size * h, *layer * self.layers, h, *head]

    def linear_layers(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of one decoder layer, by its
        Hugging Face name (the names LoRA's `target_modules` use)."""
        h, a, kv, i = self.hidden_size, self.attention_width, self.kv_width, self.intermediate_size
        return {
            "q_proj": (h, a),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (a, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def parameters(self) -> int:
        """Number of parameters: embeddings, per layer 2 norms, q/k/v (+ biases) and o
        projections, gate/up/down, then the final norm and the head (none when tied)."""
        return sum(self.tensor_sizes())

    def largest_tensor(self) -> int:
        """Elements of the largest parameter tensor (the embedding or the head here)."""
        return max(self.tensor_sizes())

    def persistent_parameters(self) -> int:
        """Parameters that ZeRO-3 keeps whole on every rank (the small tensors)."""
        return sum(n for n in self.tensor_sizes() if n < PERSISTENCE_THRESHOLD)


def shape_from_config(config: dict, source: str) -> ModelShape:
    """A `ModelShape` from a Hugging Face `config.json` dict (Qwen2 and Llama keys)."""
    config = config.get("text_config", config)
    missing = [
        key
        for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
        if key not in config
    ]
    if missing or "vocab_size" not in config:
        raise ModelShapeError(
            f"{source} lacks {', '.join(missing or ['vocab_size'])}: the planner reads "
            "decoder-only causal LMs with a Qwen2 or Llama config"
        )
    heads = config["num_attention_heads"]
    model_type = config.get("model_type", "")
    return ModelShape(
        layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        # transformers' Qwen2 and Llama configs default to untied
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        source=source,
    )


def preset_shape(name: str) -> ModelShape:
    """The shape of a built-in preset, from its spec (nothing is built)."""
    from cagrpo_ray.policies.build import PRESETS
    from cagrpo_ray.policies.tokenizer import char_tokenizer

    size = PRESETS[name].size
    return ModelShape(
        layers=size.num_layers,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size,
        num_heads=size.num_heads,
        num_kv_heads=size.num_heads,
        head_dim=size.hidden_size // size.num_heads,
        vocab_size=len(char_tokenizer()),
        tied_embeddings=True,
        qkv_bias=True,
        source=f"preset {name!r} (cagrpo_ray/policies/build.py)",
    )


def known_hub_models() -> dict[str, dict]:
    """The hub models whose shapes ship in `models.json`, by hub id."""
    return json.loads(MODELS_FILE.read_text())["models"]


def _is_preset(name: str) -> bool:
    # the presets are plain names; importing the policy builder only for those keeps the hub
    # and folder cases quick
    if "/" in name:
        return False
    from cagrpo_ray.policies.build import PRESETS

    return name in PRESETS


def model_shape(path: str, online: bool = False, gguf_file: str | None = None) -> ModelShape:
    """The shape of `model.path`: a folder with a config.json, a built-in preset, a GGUF file
    (the built-in pretrained one, a `.gguf` path or `gguf_file` in the folder: its cached
    conversion, made first if need be), or a hub id listed in `models.json`. With `online`,
    another hub id's config.json is downloaded (transformers' `AutoConfig`); without, it is an
    error that names the file to extend."""
    from cagrpo_ray.policies.gguf import GGUF_PRESETS

    if gguf_file is not None or path in GGUF_PRESETS or path.endswith(".gguf"):
        from cagrpo_ray.policies.build import resolve_policy

        path = resolve_policy(path, gguf_file=gguf_file)
    folder = Path(path)
    if folder.is_dir():
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise ModelShapeError(f"model folder {path} has no config.json")
        return shape_from_config(json.loads(config_file.read_text()), str(config_file))
    if _is_preset(path):
        return preset_shape(path)
    known = known_hub_models()
    if path in known:
        entry = known[path]
        return shape_from_config(entry, f"{MODELS_FILE.name}: {entry.get('source', path)}")
    if online:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path).to_dict()
        return shape_from_config(config, f"config.json of {path} (downloaded)")
    raise ModelShapeError(
        f"no shape known for model {path!r}: it is neither a folder here nor a preset, and "
        f"{MODELS_FILE} lists only {', '.join(sorted(known))}; add its config.json values there "
        "(layers, hidden and intermediate size, heads, KV heads, vocabulary) or point "
        "model.path at a local folder holding its config.json"
    )
