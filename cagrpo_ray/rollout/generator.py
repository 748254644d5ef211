"""The generator replica: one engine (vLLM or HF) and its end of the weight-sync group.

`Generator` is a plain class; `GeneratorActor` is the same class as a Ray actor that runs its
calls in a thread pool, so that every request the pool sends is in flight at once (the vLLM
engine batches them all), and that Ray restarts when it dies: a restarted replica comes back
with the initial weights, and the pool resyncs it before it serves again.

New weights go in between requests, never in the middle of one: `receive_weights` first
closes the gate to new requests, waits until the requests in flight have finished (they keep
the version they started with), loads, and opens the gate again. The pool sends no new request
to a replica while its load is pending, so every completion's `policy_version` is the version
it was sampled with, and no request is ever cut in half. With `rollout.weight_update:
in_flight` (vLLM) the gate still closes, but the requests in flight are not waited for: the
engine freezes them for the load and they go on under the new weights (`vllm_engine.py`), so
no replica idles for a sync; each completion's `loads` says which of its tokens came after.

Every sample is an episode (`cagrpo_ray/env`): with `rollout.max_turns` > 1 the replica runs
the policy's turns on its engine and the tools in between (`run_episodes`); a single-turn task
is the one-turn case, whose episodes are the engine's samples as they were. A chunk's call
returns once all its episodes have ended, so a drain waits for whole episodes and every token
of an episode has one version.

A replica whose engine died (its core process, a worker, or a reload that left the model
half-loaded) ends the engine's remaining processes and exits, so that Ray restarts it instead
of it answering with errors.
"""

from __future__ import annotations

import logging
import os
import threading

import ray

from cagrpo_ray.console import redirect_output
from cagrpo_ray.env.episode import SINGLE_TURN, ToolEnvironment, run_episodes, text_encoder
from cagrpo_ray.processes import terminate_then_kill
from cagrpo_ray.types import Completion, SamplingConfig

from .engines import make_engine

log = logging.getLogger(__name__)

# Calls one replica runs at once: chunks of prompts in flight, plus a weight receive, a health
# probe and the sync group's join.
MAX_CONCURRENT_CALLS = 256


class Generator:
    """Hosts one generation engine; `generate` returns `Completion`s tagged with its version."""

    def __init__(
        self,
        replica: int,
        engine: str,
        model_path: str,
        engine_options: dict,
        environment: dict | None = None,
    ):
        redirect_output()  # as an actor of a run: vLLM's output goes to the run's log file
        self.replica = replica
        self.engine = make_engine(engine, model_path, **engine_options)
        environment = dict(environment or {})
        self.max_turns = environment.pop("max_turns", 1)
        self.env = ToolEnvironment(**environment) if self.max_turns > 1 else SINGLE_TURN
        self._encode = text_encoder(self.engine.tokenizer)
        self._gate = threading.Condition()
        self._in_flight = 0
        self._loading = False
        # An engine that cannot serve two calls at once (the HF one) gets them one at a time.
        self._serial = None if getattr(self.engine, "concurrent", False) else threading.Lock()

    def ready(self) -> dict:
        """This replica's identity and version, after probing that its engine is alive."""
        check = getattr(self.engine, "check_health", None)
        if check is not None:
            try:
                check()
            except Exception as exc:
                _exit_for_restart(self.replica, f"its engine failed a health check: {exc}")
        return {"replica": self.replica, "pid": os.getpid(), "version": self.policy_version()}

    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        with self._gate:
            self._gate.wait_for(lambda: not self._loading)
            self._in_flight += 1
        try:
            # a single-turn task is the one-turn episode: the engine's samples as they are
            return run_episodes(self._generate, self.env, self._encode, prompts, sampling,
                                self.max_turns, later=self._later_turn)  # fmt: skip
        except Exception as exc:
            if _engine_dead(exc):
                _exit_for_restart(self.replica, f"its engine died: {exc}")
            raise
        finally:
            with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig):
        if self._serial is None:
            return self.engine.generate(prompts, sampling)
        with self._serial:
            return self.engine.generate(prompts, sampling)

    def _later_turn(self, prompts: list[list[int]], sampling: SamplingConfig):
        """An episode's next turn. Under a drain it goes on (the load waits for the episode);
        with in-flight loads it waits for a load to end rather than join a paused engine."""
        if getattr(self.engine, "in_flight_updates", False):
            with self._gate:
                self._gate.wait_for(lambda: not self._loading)
        return self._generate(prompts, sampling)

    def parameter_digests(self) -> list[dict[str, str]]:
        """sha256 of every parameter the engine keeps as a tensor, per worker (vLLM only)."""
        return self.engine.parameter_digests()

    def init_weight_sync(self, address: dict, rank_offset: int) -> list[int]:
        """Join the learner's weight-sync group; returns the sync ranks of its workers."""
        return self.engine.init_weight_sync(address, rank_offset)

    def receive_weights(self, version: int) -> dict:
        """Drain the requests in flight, then load `version` (see the module docstring); an
        engine with in-flight updates loads with its requests frozen instead."""
        with self._gate:
            self._loading = True  # new calls wait for the load
            if not getattr(self.engine, "in_flight_updates", False):
                self._gate.wait_for(lambda: self._in_flight == 0)
        try:
            return self.engine.receive_weights(version)
        except Exception as exc:
            from .worker_extension import MODEL_UNUSABLE

            if MODEL_UNUSABLE in str(exc) or _engine_dead(exc):
                _exit_for_restart(self.replica, f"loading v{version} broke its engine: {exc}")
            raise
        finally:
            with self._gate:
                self._loading = False
                self._gate.notify_all()


def _engine_dead(exc: BaseException) -> bool:
    """vLLM's EngineDeadError (its core process or a worker is gone), without importing vLLM."""
    return any(type(e).__name__ == "EngineDeadError" for e in _chain(exc))


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _exit_for_restart(replica: int, why: str) -> None:
    log.error("generator replica %d exits so that Ray restarts it: %s", replica, why)
    end_children()
    logging.shutdown()
    os._exit(1)


def end_children(grace_s: float = 5.0) -> None:
    """End every process this one started (vLLM's engine core and its workers), and wait for
    them, so that the restarted replica finds their memory free: SIGTERM, then SIGKILL after
    `grace_s`. (A replica killed from outside cannot do this; its process group, which the
    raylet ends with `RAY_process_group_cleanup_enabled`, covers that case.)"""
    import psutil  # a vLLM dependency

    terminate_then_kill(psutil.Process().children(recursive=True), grace_s)


GeneratorActor = ray.remote(
    max_restarts=-1, max_task_retries=0, max_concurrency=MAX_CONCURRENT_CALLS
)(Generator)
