"""`VLLMEngine` bounds its waits itself: vLLM's uniproc executor (tensor-parallel size 1)
ignores collective_rpc's timeout (`v1/executor/uniproc_executor.py`, 0.32 and 0.33.0 alike),
so a worker stuck in a weight sync would hold the replica forever. An engine whose RPC never
answers stands in for it here, on the same event-loop thread the real one uses; every call
into the worker extension, and every other wait but generation and start-up, is bounded and
names what it waited for and on which replica."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import itertools
import textwrap
import threading
import time

import pytest
import torch

from cagrpo_ray.config.sections import LoraConfig
from cagrpo_ray.policies.lora import LoraSpec
from cagrpo_ray.rollout import vllm_engine
from cagrpo_ray.rollout.vllm_engine import VLLMEngine
from cagrpo_ray.sync import WeightSyncError

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]


class _StuckEngine:
    """An AsyncLLM whose collective_rpc never returns, whatever its `timeout`, except for the
    methods in `answers` ({method: the workers' results}); its control calls never return
    either, except those in `answers` too (their result)."""

    def __init__(self, answers: dict | None = None):
        self.cancelled = threading.Event()
        self.answers = answers or {}

    async def _stuck(self, name: str):
        if name in self.answers:
            return self.answers[name]
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def collective_rpc(self, method, timeout=None, args=()):
        return await self._stuck(method)

    def check_health(self):
        return self._stuck("check_health")

    def reset_prefix_cache(self, reset_running_requests=False):
        return self._stuck("reset_prefix_cache")

    def pause_generation(self, mode="abort", clear_cache=True):
        return self._stuck("pause_generation")

    def resume_generation(self):
        return self._stuck("resume_generation")


def _engine(stuck: _StuckEngine, **fields) -> VLLMEngine:
    """A VLLMEngine's loop thread and fields around `stuck`, without a vLLM engine."""
    engine = object.__new__(VLLMEngine)
    engine._loop = asyncio.new_event_loop()
    engine._thread = threading.Thread(target=engine._loop.run_forever, daemon=True)
    engine._thread.start()
    engine.engine, engine.num_sync_ranks, engine.model_path = stuck, 1, "/m/policy"
    engine.replica, engine.lora, engine.in_flight_updates = 2, None, False
    engine._serving, engine._adapter_loads = (0, None), itertools.count(1)
    engine._live, engine._loads = {}, {}
    engine._rpc_timeout_s = 1.0
    for name, value in fields.items():
        setattr(engine, name, value)
    return engine


def _stop(engine: VLLMEngine) -> None:
    engine._loop.call_soon_threadsafe(engine._loop.stop)
    engine._thread.join(5)


def test_a_sync_rpc_that_never_answers_fails_naming_what_and_whom(monkeypatch):
    engine = _engine(_StuckEngine())
    monkeypatch.setattr(VLLMEngine, "RPC_TIMEOUT_MARGIN_S", 1.0)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as error:
            engine._sync_rpc("receive_weights", 3, False)
        waited = time.monotonic() - start
        assert 2.0 <= waited < 10
        assert str(error.value) == (
            "vLLM engine, receive_weights: generator replica 2 (1 worker(s) serving /m/policy): "
            "no answer to 'receive_weights' within 2 s"
        )
        assert engine.engine.cancelled.wait(5)  # the wait on the loop ended too
    finally:
        _stop(engine)


SPEC = LoraSpec.from_config(LoraConfig(rank=4, alpha=8.0))
ADAPTER = [("base_model.model.layers.0.q_proj.lora_A.weight", torch.zeros(4, 8))]
# (what is called, the engine's fields, what answers, the wait named in the error)
STUCK_CALLS = {
    "load_weights": (lambda e: e.load_weights([("w", torch.zeros(2))], 1), {}, {},
                     "'load_serialized_weights'"),
    "load_weights (LoRA)": (lambda e: e.load_weights(ADAPTER, 1), {"lora": SPEC}, {},
                            "'load_serialized_adapter'"),
    "parameter_digests": (lambda e: e.parameter_digests(), {}, {}, "'parameter_digests'"),
    "receive_weights (LoRA)": (lambda e: e.receive_weights(1), {"lora": SPEC}, {},
                               "'receive_adapter'"),
    "the served adapter's checksum": (
        lambda e: e.receive_weights(1), {"lora": SPEC},
        {"receive_adapter": [{"num_bytes": 1, "seconds": 0.1}]}, "'served_adapter_checksum'",
    ),
    "the prefix-cache reset after a load": (
        lambda e: e.receive_weights(1), {}, {"receive_weights": [{"num_bytes": 1, "seconds": 0.1}]},
        "a prefix-cache reset",
    ),
    "pausing for an in-flight load": (lambda e: e.receive_weights(1),
                                      {"in_flight_updates": True}, {}, "pausing its requests"),
    "resuming after an in-flight load": (
        lambda e: e.receive_weights(1), {"in_flight_updates": True},
        {"pause_generation": None, "receive_weights": [{"num_bytes": 1, "seconds": 0.1}],
         "reset_prefix_cache": None},
        "resuming its requests",
    ),
    "check_health": (lambda e: e.check_health(timeout_s=1.0), {}, {}, "a health check"),
}  # fmt: skip


@pytest.mark.parametrize("case", STUCK_CALLS)
def test_every_wait_on_the_engine_is_bounded_and_names_what_and_whom(case, monkeypatch):
    call, fields, answers, what = STUCK_CALLS[case]
    engine = _engine(_StuckEngine(answers), **fields)
    monkeypatch.setattr(VLLMEngine, "RPC_TIMEOUT_MARGIN_S", 0.5)
    monkeypatch.setattr(VLLMEngine, "CONTROL_TIMEOUT_S", 1.0)
    try:
        start = time.monotonic()
        with pytest.raises((TimeoutError, WeightSyncError)) as error:
            call(engine)
        assert time.monotonic() - start < 10
        assert f"generator replica 2 (1 worker(s) serving /m/policy): no answer to {what}" in (
            str(error.value)
        ), error.value
    finally:
        _stop(engine)


def test_only_the_bounded_helpers_wait_on_the_engine_without_a_bound():
    """The source: `collective_rpc` is called in `_rpc` alone, every `_rpc` call passes a
    timeout, and the unbounded `_run` serves only the engine's start and generation."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(VLLMEngine)))
    methods = {node.name: node for node in tree.body[0].body if isinstance(node, ast.FunctionDef)}
    callers = {"collective_rpc": set(), "_run": set()}
    for name, node in methods.items():
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            called = getattr(call.func, "attr", None)
            if called in callers:
                callers[called].add(name)
            if called == "_rpc":
                assert any(k.arg == "timeout" for k in call.keywords), (name, ast.unparse(call))
    assert callers == {"collective_rpc": {"_rpc"}, "_run": {"__init__", "generate"}}
    # The RPC names that reach the workers are the worker extension's methods.
    from cagrpo_ray.rollout.worker_extension import WeightSyncExtension

    source = inspect.getsource(vllm_engine)
    public = [m for m in vars(WeightSyncExtension) if not m.startswith("_")]
    assert all(f'"{m}"' in source for m in public), public


def test_a_run_s_engine_options_name_the_replica_and_each_reaches_a_parameter():
    from vllm import AsyncEngineArgs

    from cagrpo_ray.config import load_config
    from cagrpo_ray.rollout.engines import engine_options

    config = load_config("configs/cpu-tiny.yaml", ["model.lora.rank=4", "run.mode=async"])
    options = engine_options(config, 3)
    assert options["replica"] == 3
    accepted = set(inspect.signature(VLLMEngine).parameters) | {
        f.name for f in dataclasses.fields(AsyncEngineArgs)
    }
    assert set(options) <= accepted, set(options) - accepted
