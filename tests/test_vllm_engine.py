"""`VLLMEngine._sync_rpc` bounds its wait itself: vLLM's uniproc executor (tensor-parallel size
1) ignores collective_rpc's timeout (`v1/executor/uniproc_executor.py`, 0.32 and 0.33.0 alike),
so a worker stuck in a weight sync would hold the replica forever. An engine whose RPC never
answers stands in for it here, on the same event-loop thread the real one uses."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cagrpo_ray.rollout.vllm_engine import VLLMEngine
from cagrpo_ray.sync import WeightSyncError

pytestmark = pytest.mark.unit


class _StuckEngine:
    """An AsyncLLM whose collective_rpc never returns, whatever its `timeout`."""

    def __init__(self):
        self.cancelled = threading.Event()

    async def collective_rpc(self, method, timeout=None, args=()):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_sync_rpc_that_never_answers_fails_naming_what_and_whom(monkeypatch):
    engine = object.__new__(VLLMEngine)  # its loop thread and fields, without a vLLM engine
    engine._loop = asyncio.new_event_loop()
    thread = threading.Thread(target=engine._loop.run_forever, daemon=True)
    thread.start()
    engine.engine, engine.num_sync_ranks, engine.model_path = _StuckEngine(), 1, "/m/policy"
    engine._rpc_timeout_s = 1.0
    monkeypatch.setattr(VLLMEngine, "RPC_TIMEOUT_MARGIN_S", 1.0)
    try:
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as error:
            engine._sync_rpc("receive_weights", 3, False)
        waited = time.monotonic() - start
        assert 2.0 <= waited < 10
        assert str(error.value) == (
            "vLLM engine, receive_weights: vLLM engine (1 worker(s) serving /m/policy): no "
            "answer to 'receive_weights' within 2 s"
        )
        assert engine.engine.cancelled.wait(5)  # the wait on the loop ended too
    finally:
        engine._loop.call_soon_threadsafe(engine._loop.stop)
        thread.join(5)
