"""The roles of one run, built in order: the verifiers' actor, the memory plan's check, the
reservation of every actor's GPUs and CPUs (`Placement`), the generator replicas and their
pool, and the learner ranks, which start while the replicas load.

`build_roles` fills the `Roles` it is given as it goes, so that whoever holds it can end what
started if a later role fails (`Roles.close`); it never leaves an actor that nobody holds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from cagrpo_ray.config import Config
from cagrpo_ray.console import actor_env, redirected
from cagrpo_ray.env.episode import environment_options
from cagrpo_ray.placement import Placement, describe_nodes, node_addresses
from cagrpo_ray.rollout.engines import cpu_engine_env, engine_options
from cagrpo_ray.rollout.generator import GeneratorActor
from cagrpo_ray.rollout.kept import KeptGenerators, replica_key
from cagrpo_ray.rollout.pool import GeneratorPool

log = logging.getLogger("cagrpo_ray")


def check_plan(config: Config) -> None:
    """The planner's check (`python -m cagrpo_ray.plan`) against the cluster the run joined:
    raises `PlanError` naming the GPU and the component that does not fit, or the tensor-
    parallel size the model's heads do not allow. A model whose shape cannot be read (a hub
    model out of reach) is not planned, with a warning."""
    from cagrpo_ray.plan import ClusterShape, ModelShapeError, check, render

    gpus = config.rollout.num_gpus_per_generator or config.learner.num_gpus_per_learner
    cluster = ClusterShape.from_ray(config.cluster.gpu_memory_gib) if gpus else None
    try:
        log.info("plan:\n%s", render(check(config, cluster, online=True)))
    except ModelShapeError as exc:
        log.warning("no memory plan: %s", exc)


def cpu_env(config: Config, replica: int) -> dict:
    """The environment of CPU replica `replica` (its OpenMP threads' cores); {} on GPUs."""
    if config.rollout.num_gpus_per_generator > 0:
        return {}
    return cpu_engine_env(config.rollout, replica, os.cpu_count() or 1)


def generator_env(config: Config, log_dir: Path, replica: int) -> dict:
    """The environment of generator replica `replica`: its log file, vLLM's log level, its
    CPU cores."""
    env = {"VLLM_LOGGING_LEVEL": "INFO", **actor_env(log_dir, f"generator-{replica}")}
    return {**env, **cpu_env(config, replica)}


@dataclass
class Roles:
    """The actors of one run (each None until started)."""

    reward_pool: Any = None  # the verifiers' actor (`rewards.RewardFunction`)
    placement: Placement | None = None  # every actor's GPUs and CPUs, reserved
    pool: GeneratorPool | None = None  # the generator replicas
    learners: Any = None  # the learner ranks (`learner.group.LearnerGroup`)
    nodes: dict[str, str] | None = None  # role ("generator 0", ...) -> its node's address

    def close(self, keep_generators: bool = False) -> None:
        """End the learner ranks, the verifiers and (unless they are kept for another run)
        the generator replicas, and free the reservations."""
        if self.learners is not None:
            self.learners.shutdown()
        actors = list(self.pool.actors) if self.pool is not None and not keep_generators else []
        for actor in [*actors, self.reward_pool]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
        self.reward_pool, self.learners, self.placement = None, None, None


def build_roles(
    config: Config,
    model_path: str,
    log_dir: Path,
    kept: KeptGenerators | None,
    start_learners: Callable[[], Any],
    wait: Callable[[list, str], list],
    roles: Roles,
) -> Roles:
    """Start the run's roles into `roles` (module docstring). `kept`: generator replicas to
    take, when started as this run would start them (`rollout/kept.py`), and to leave the
    new ones in otherwise; `start_learners()`: the learner group, built once `roles.placement`
    holds its reservation; `wait(refs, what)`: a `ray.get` that logs long waits."""
    from cagrpo_ray.rewards import RewardFunction, load_reward_functions

    cfg = config
    # imported and signature-checked here, so that a bad one stops the run before it trains
    functions = {n: f.spec for n, f in load_reward_functions(cfg.reward.functions).items()}
    reward_actor = ray.remote(num_cpus=cfg.reward.num_cpus)(redirected(RewardFunction))
    labels = {"label_selector": dict(cfg.reward.node_labels)} if cfg.reward.node_labels else {}
    roles.reward_pool = reward_actor.options(
        runtime_env={"env_vars": actor_env(log_dir, "reward")}, **labels
    ).remote(
        weights=cfg.reward.weights,
        timeout_s=cfg.reward.timeout_s,
        num_workers=cfg.reward.num_workers,
        functions=functions,
        on_error=cfg.reward.on_error,
    )
    # Memory and layout are checked, then every actor's GPUs and CPUs are reserved (or the
    # layout refused), before any actor starts.
    check_plan(cfg)
    replicas = range(cfg.rollout.num_generators)
    key = replica_key(cfg, model_path, [cpu_env(cfg, r) for r in replicas])
    reuse = kept is not None and kept.fits(key)
    if kept is not None and not reuse:
        kept.close()  # replicas started otherwise: their CPUs and GPUs go to this run's
    roles.placement = Placement(cfg, timeout_s=cfg.run.placement_timeout_s, generators=not reuse)
    if reuse:
        generators = list(kept.actors)
        log.info("%d generator replicas kept up from the run before", len(generators))
    else:
        generators = [
            GeneratorActor.options(
                **roles.placement.generator(replica),
                runtime_env={"env_vars": generator_env(cfg, log_dir, replica)},
            ).remote(
                replica,
                cfg.rollout.engine,
                model_path,
                engine_options(cfg, replica),
                environment_options(cfg),
            )
            for replica in replicas
        ]
        if kept is not None:
            kept.hold(generators, roles.placement.hand_over_generators(), key)
    roles.pool = GeneratorPool(
        generators,
        cfg.rollout.chunk_prompts,
        cfg.run.wait_warn_s,
        max_prompts_in_flight=cfg.rollout.max_prompts_in_flight,
    )
    # The learner ranks start while the replicas load (each takes tens of seconds).
    with ThreadPoolExecutor(1, thread_name_prefix="learner-start") as start:
        learners = start.submit(start_learners)
        try:
            wait([g.ready.remote() for g in generators], "generator replicas to start")
            wait([roles.reward_pool.wait_ready.remote()], "verifier workers to start")
        finally:  # a failed replica still leaves the started ranks to close()
            failed = learners.exception()
            roles.learners = None if failed else learners.result()
        if failed:
            raise failed
    actors = {f"generator {i}": g for i, g in enumerate(generators)}
    actors.update({f"learner {r}": a for r, a in enumerate(roles.learners.actors)})
    roles.nodes = node_addresses({**actors, "the reward pool": roles.reward_pool})
    log.info("actors by node: %s", describe_nodes(roles.nodes))
    return roles
