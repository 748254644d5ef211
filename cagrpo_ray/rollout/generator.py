"""The generator replica: one engine (vLLM or HF) and its end of the weight-sync group.

`Generator` is a plain class; `GeneratorActor` is the same class as a Ray actor, restarted by
Ray when it dies (a restarted replica comes back with the initial weights, and the trainer
syncs it before it serves again).
"""

from __future__ import annotations

import os

import ray

from .engines import make_engine
from .types import Completion, SamplingConfig


class Generator:
    """Hosts one generation engine; `generate` returns `Completion`s tagged with its version."""

    def __init__(self, replica: int, engine: str, model_path: str, engine_options: dict):
        self.replica = replica
        self.engine = make_engine(engine, model_path, **engine_options)

    def ready(self) -> dict:
        return {"replica": self.replica, "pid": os.getpid(), "version": self.policy_version()}

    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        return self.engine.generate(prompts, sampling)

    def init_weight_sync(self, address: dict, rank_offset: int) -> list[int]:
        """Join the learner's weight-sync group; returns the sync ranks of its workers."""
        return self.engine.init_weight_sync(address, rank_offset)

    def receive_weights(self, version: int) -> dict:
        return self.engine.receive_weights(version)


GeneratorActor = ray.remote(max_restarts=-1, max_task_retries=0)(Generator)
