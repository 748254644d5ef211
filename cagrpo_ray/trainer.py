"""The synchronous training loop: generate, score, buffer, train, sync, repeat.

`Trainer` composes the roles (generator replicas, reward pool, rollout buffer, learner group,
weight sync) from a `Config`; each role is a plain class that Ray wraps. One step:

    prompts ─> GeneratorPool.generate (G samples each) ─> RewardPool ─> RolloutBuffer
            ─> LearnerGroup.train_step ─> weight sync (learner rank 0 ─> every generator)

A run directory holds `metrics.jsonl`, `checkpoints/step_NNNNNN/` (learner state, trainer
state: step, data cursor, policy version, RNG), end-of-run plots and `summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import RayActorError, RayError

from cagrpo_ray.algo.advantages import group_advantages
from cagrpo_ray.config import Config
from cagrpo_ray.data.prompts import R1_INSTRUCTION, format_prompt
from cagrpo_ray.metrics.jsonl import MetricsLog, read_metrics
from cagrpo_ray.metrics.plots import plot_run, write_summary
from cagrpo_ray.rollout.buffer import RolloutBuffer, group_record_batch, to_learner_batch
from cagrpo_ray.rollout.generator import GeneratorActor
from cagrpo_ray.rollout.pool import GeneratorPool
from cagrpo_ray.rollout.types import SamplingConfig

log = logging.getLogger("cagrpo_ray")

STATE_FILE = "trainer_state.json"


def instruction_text(config: Config) -> str | None:
    value = config.data.instruction
    return {"r1": R1_INSTRUCTION, "none": None}.get(value, value)


# ---------------------------------------------------------------- functions run on learners


def _open_sender(learner, world_size: int, backend: str, timeout_s: float, bucket_mb: float):
    """On learner rank 0: start the weight-sync group's store and return its address."""
    from cagrpo_ray.sync import WeightSender

    if learner.rank != 0:
        return None
    old = getattr(learner, "weight_sender", None)
    if old is not None:
        old.close()
    host = ray.util.get_node_ip_address()
    learner.weight_sender = WeightSender(
        host=host,
        port=0,
        world_size=world_size,
        backend=backend,
        timeout_s=timeout_s,
        bucket_mb=bucket_mb,
    )
    return dataclasses.asdict(learner.weight_sender.address)


def _send_weights(learner, version: int):
    """Every rank takes part in gathering (ZeRO-3); rank 0 broadcasts to the generators."""
    tensors = learner.iter_sync_weights()
    if learner.rank != 0:
        for _ in tensors:
            pass
        return None
    from cagrpo_ray.sync import WeightSyncError

    try:
        stats = learner.weight_sender.send(tensors, version)
    except WeightSyncError as exc:
        for _ in tensors:  # keep every rank's ZeRO-3 gathers matched
            pass
        return {"error": str(exc)}
    return dataclasses.asdict(stats)


def required_cpus(config: Config) -> float:
    """Ray CPUs that the run's actors ask for (a local cluster gets at least this many)."""
    r, lcfg = config.rollout, config.learner
    return (
        r.num_generators * r.num_cpus_per_generator
        + lcfg.num_learners * lcfg.num_cpus_per_learner
        + config.reward.num_cpus
    )


def idle_fraction(busy_seconds: float, replicas: int, wall_seconds: float) -> float:
    """Share of the replicas' wall time in which none of their requests was running."""
    if replicas == 0 or wall_seconds <= 0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - busy_seconds / (replicas * wall_seconds))))


class Trainer:
    """Runs one training job described by `config`; `run()` returns the final summary."""

    def __init__(self, config: Config, resume: bool = False):
        self.config = config
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.ckpt_root = self.run_dir / "checkpoints"
        self.resume = resume
        self.step = 0
        self.cursor = 0  # index of the next training prompt
        self.policy_version = 0
        self.checkpointed_step: int | None = None  # step of the newest checkpoint on disk
        self.stop_requested = False
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.exporter = None

    # ------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        from cagrpo_ray.learner.group import LearnerGroup
        from cagrpo_ray.policies.build import resolve_policy
        from cagrpo_ray.rewards import RewardFunction

        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)

        self.model_path = str(resolve_policy(cfg.model.path))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.train_source, self.eval_items = self._sources()
        log.info(
            "policy %s; %d training prompts, %d held-out prompts",
            self.model_path,
            len(self.train_source),
            len(self.eval_items),
        )

        reward_actor = ray.remote(num_cpus=cfg.reward.num_cpus)(RewardFunction)
        self.reward_pool = reward_actor.remote(
            weights=cfg.reward.weights,
            timeout_s=cfg.reward.timeout_s,
            num_workers=cfg.reward.num_workers,
        )
        self.generators = [
            GeneratorActor.options(
                num_cpus=cfg.rollout.num_cpus_per_generator,
                num_gpus=cfg.rollout.num_gpus_per_generator,
                runtime_env={"env_vars": self._generator_env(replica)},
            ).remote(replica, cfg.rollout.engine, self.model_path, self._engine_options(replica))
            for replica in range(cfg.rollout.num_generators)
        ]
        self._wait([g.ready.remote() for g in self.generators], "generator replicas to start")
        self.pool = GeneratorPool(
            self.generators,
            cfg.rollout.chunk_prompts,
            cfg.run.wait_warn_s,
            on_restart=self._on_generator_restart,
        )
        self.learners = LearnerGroup(
            cfg.learner.num_learners,
            self._learner_kwargs(),
            num_cpus_per_learner=cfg.learner.num_cpus_per_learner,
            num_gpus_per_learner=cfg.learner.num_gpus_per_learner,
        )
        self.buffer = RolloutBuffer()
        if cfg.metrics.enabled:
            from cagrpo_ray.metrics.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter(cfg.run.name, cfg.metrics.port, cfg.metrics.host)
            self.exporter.start()
            log.info("metrics for Prometheus at %s", self.exporter.url)
        if self.resume:
            self._load_latest_checkpoint()
        self._build_sync_group()
        self.sync_weights()  # generators serve the learner's weights from the first step

    def _sources(self):
        from cagrpo_ray.data.files import FilePromptSource
        from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource

        d = self.config.data
        if d.source == "reasoning_gym":
            train = ReasoningGymSource(d.dataset, d.dataset_config, d.seed, d.train_size, "train")
            held_out = ReasoningGymSource(
                d.dataset,
                d.dataset_config,
                d.seed,
                d.eval_size,
                "eval",
                exclude_sizes=self._held_out_exclusions(),
            )
            return train, list(held_out.iter_from(0))
        if d.path is None or d.eval_path is None:
            raise ValueError("data.source 'file' needs data.path and data.eval_path")
        kwargs = dict(
            question_column=d.question_column,
            answer_column=d.answer_column,
            on_bad_row=d.on_bad_row,
        )
        train = FilePromptSource(d.path, **kwargs)
        held_out = FilePromptSource(d.eval_path, **kwargs)
        return train, list(held_out.iter_from(0))[: d.eval_size]

    def _generator_env(self, replica: int) -> dict:
        env = {"VLLM_LOGGING_LEVEL": "WARNING"}
        if self.config.rollout.num_gpus_per_generator == 0:
            # vLLM on the CPU binds its OpenMP threads; left to "auto", every replica on a
            # node picks the same core. One core per replica, round robin over the node's.
            cores = os.cpu_count() or 1
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(replica % cores)
        return env

    def _held_out_exclusions(self) -> dict[str, int]:
        """Held-out prompts exclude the RL prompts and, for a built-in policy warm-started on
        the same task, seed and config, its warm-start questions too."""
        from cagrpo_ray.policies.build import PRESETS

        d = self.config.data
        exclude = {"train": d.train_size}
        spec = PRESETS.get(self.config.model.path)
        if (
            spec is not None
            and spec.task == d.dataset
            and spec.task_config == d.dataset_config
            and spec.seed == d.seed
        ):
            exclude["sft"] = spec.sft_size
        return exclude

    def _engine_options(self, replica: int) -> dict:
        r = self.config.rollout
        options = dict(
            seed=self.config.run.seed + replica,
            max_model_len=r.max_model_len,
            dtype=self.config.model.dtype,
        )
        if r.engine == "vllm":
            options["tensor_parallel_size"] = r.tensor_parallel_size
            if r.num_gpus_per_generator > 0:
                options["gpu_memory_utilization"] = r.gpu_memory_utilization
            else:
                options["kv_cache_gib"] = r.kv_cache_gib
        return options

    def _learner_kwargs(self) -> dict:
        a, lcfg = self.config.algorithm, self.config.learner
        return dict(
            model_path=self.model_path,
            zero_stage=lcfg.zero_stage,
            lr=a.lr,
            warmup_steps=a.warmup_steps,
            weight_decay=a.weight_decay,
            grad_clip=a.grad_clip,
            micro_batch_size=lcfg.micro_batch_size,
            policy_loss=a.policy_loss,
            clip_eps_low=a.clip_eps_low,
            clip_eps_high=a.clip_eps_high,
            loss_agg=a.loss_agg,
            cov_scope=a.cov_scope,
            cagrpo_kernel=a.cagrpo_kernel,
            std_normalize=a.std_normalize,
            temperature=self.config.rollout.temperature,
            ref_model_path=self.model_path if a.kl_coef > 0 else None,
            kl_coef=a.kl_coef,
            entropy_coef=a.entropy_coef,
            tis_cap=a.tis_cap,
            max_response_length=self.config.rollout.max_tokens,
            seed=self.config.run.seed,
        )

    # ------------------------------------------------------------------- weight sync

    def _build_sync_group(self) -> None:
        s = self.config.sync
        workers = self.config.rollout.tensor_parallel_size
        world = 1 + workers * len(self.generators)
        address = self.learners.foreach_learner(
            _open_sender, world, s.backend, s.timeout_s, s.bucket_mb
        )[0]
        refs = [
            g.init_weight_sync.remote(address, 1 + i * workers)
            for i, g in enumerate(self.generators)
        ]
        self._wait(refs, "generator workers to join the weight-sync group")

    def sync_weights(self, attempts: int = 3) -> dict:
        """Broadcast the learner's weights as `policy_version` to every generator.

        A generator that dies during a sync (or a sync that times out) costs a rebuilt group
        and another attempt once every replica answers again, not the run.
        """
        start = time.perf_counter()
        version = self.policy_version
        for attempt in range(1, attempts + 1):
            refs = [g.receive_weights.remote(version) for g in self.generators]
            sent = self.learners.foreach_learner(_send_weights, version)[0]
            problems = [] if "error" not in sent else [f"learner: {sent['error']}"]
            for replica, ref in enumerate(refs):
                try:
                    self._wait([ref], f"generator {replica} to load weights v{version}")
                except RayError as exc:
                    problems.append(f"generator {replica}: {type(exc).__name__}: {exc}")
                    if isinstance(exc, RayActorError):
                        self.pool.restarts += 1
            if not problems:
                self.pool.policy_version = version
                self.pool.needs_weights.clear()
                return {
                    "sync/seconds": time.perf_counter() - start,
                    "sync/bytes": sent["num_bytes"],
                }
            log.warning(
                "weight sync v%d, attempt %d of %d failed; rebuilding the group: %s",
                version,
                attempt,
                attempts,
                "; ".join(p[:300] for p in problems),
            )
            self._await_generators()
            self._build_sync_group()
        raise RuntimeError(f"weight sync v{version} failed {attempts} times; see the log")

    def _await_generators(self, timeout_s: float = 900.0) -> None:
        """Wait until every replica answers (Ray refuses calls while it restarts an actor)."""
        deadline = time.monotonic() + timeout_s
        for replica, generator in enumerate(self.generators):
            while True:
                try:
                    ray.get(generator.ready.remote(), timeout=self.config.run.wait_warn_s)
                    break
                except (RayActorError, ray.exceptions.GetTimeoutError) as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"generator replica {replica} did not come back"
                        ) from exc
                    log.warning("waiting for generator replica %d to restart", replica)
                    time.sleep(1.0)

    def _on_generator_restart(self, replica: int) -> None:
        """A replica came back from a crash with its initial weights: rebuild the group."""
        log.warning(
            "generator replica %d restarted; resyncing weights v%d", replica, self.policy_version
        )
        self._await_generators()
        self._build_sync_group()
        self.sync_weights()

    # ------------------------------------------------------------------------- the loop

    def _next_prompts(self, count: int):
        items = []
        for _ in range(count):
            if self.cursor >= len(self.train_source):
                self.cursor = 0  # a new epoch over the same prompts, in the same order
            items.append(self.train_source[self.cursor])
            self.cursor += 1
        return items

    def sampling(self, n: int, temperature: float, seed: int) -> SamplingConfig:
        r = self.config.rollout
        return SamplingConfig(
            n=n,
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_tokens,
            seed=seed,
        )

    def rollout(self, items) -> tuple[dict, float]:
        """Generate, score and buffer one step's groups; returns metrics and tokens made."""
        cfg = self.config
        instruction = instruction_text(cfg)
        prompts = [format_prompt(self.tokenizer, it.question, instruction) for it in items]
        seed = cfg.run.seed * 1_000_003 + self.step
        t0 = time.perf_counter()
        groups = self.pool.generate(
            prompts, self.sampling(cfg.rollout.group_size, cfg.rollout.temperature, seed)
        )
        t1 = time.perf_counter()
        texts = [c.text for group in groups for c in group]
        per_sample_items = [it for it in items for _ in range(cfg.rollout.group_size)]
        results = self._wait(
            [self.reward_pool.__call__.remote(texts, per_sample_items)], "verifiers"
        )[0]
        t2 = time.perf_counter()
        rewards = np.array([r.reward for r in results], dtype=np.float32)
        correct = np.array([r.correct for r in results], dtype=bool)
        errors = sum(r.error is not None for r in results)
        import torch

        advantages = group_advantages(
            torch.from_numpy(rewards),
            cfg.rollout.group_size,
            std_normalize=cfg.algorithm.std_normalize,
        ).numpy()
        g = cfg.rollout.group_size
        for k, (item, group) in enumerate(zip(items, groups, strict=True)):
            sl = slice(k * g, (k + 1) * g)
            self.buffer.add(
                group_record_batch(
                    item.uid,
                    self.step * len(items) + k,
                    group,
                    rewards[sl].tolist(),
                    correct[sl].tolist(),
                    advantages[sl].tolist(),
                )
            )
        lengths = np.array([len(c.token_ids) for group in groups for c in group])
        truncated = np.mean([c.finish_reason == "length" for group in groups for c in group])
        generated = float(lengths.sum())
        equal_groups = np.mean(
            [np.ptp(rewards[k * g : (k + 1) * g]) == 0 for k in range(len(items))]
        )
        return {
            "reward/mean": float(rewards.mean()),
            "accuracy/train": float(correct.mean()),
            "reward/verifier_errors": errors,
            "reward/equal_reward_groups": float(equal_groups),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/truncated_fraction": float(truncated),
            "time/generate": t1 - t0,
            "time/reward": t2 - t1,
            "throughput/generate_phase_tokens_per_s": generated / max(t1 - t0, 1e-9),
        }, generated

    def train_step(self) -> dict:
        cfg = self.config
        t_start = time.perf_counter()
        busy_before = sum(self.pool.busy_seconds)
        items = self._next_prompts(cfg.rollout.prompts_per_step)
        metrics, generated = self.rollout(items)
        table = self.buffer.take(len(items), min_version=self.policy_version)
        batch = to_learner_batch(table, pad_token_id=self.tokenizer.pad_token_id)
        staleness = self.policy_version - batch["policy_version"]
        t0 = time.perf_counter()
        learner_metrics = self.learners.train_step(batch)
        t1 = time.perf_counter()
        self.step += 1
        self.policy_version = self.step
        metrics.update(self.sync_weights())
        trained_tokens = float(batch["response_mask"].sum())
        step_time = time.perf_counter() - t_start
        metrics.update(
            {f"learner/{k}" if "/" not in k else k: v for k, v in learner_metrics.items()}
        )
        metrics.update(
            {
                "time/train": t1 - t0,
                "time/sync": metrics["sync/seconds"],
                "time/step": step_time,
                # per second of the whole step, as in async mode, so the two compare
                "throughput/generated_tokens_per_s": generated / step_time,
                "throughput/trained_tokens_per_s": trained_tokens / max(t1 - t0, 1e-9),
                "throughput/samples_per_s": len(batch["rewards"]) / step_time,
                "buffer/depth_groups": len(self.buffer),
                "buffer/dropped_stale_groups": self.buffer.dropped_stale,
                "staleness/mean": float(staleness.float().mean()),
                "staleness/max": int(staleness.max()),
                "staleness/values": staleness.numpy(),
                "generators/restarts": self.pool.restarts,
                "generators/idle_fraction": idle_fraction(
                    sum(self.pool.busy_seconds) - busy_before, len(self.generators), step_time
                ),
                "policy_version": self.policy_version,
                "data/cursor": self.cursor,
                "tokens/generated": generated,
            }
        )
        return metrics

    def evaluate(self, label: str) -> dict:
        from cagrpo_ray.eval import evaluate

        cfg = self.config
        reward_fn = _RemoteRewardFunction(self.reward_pool)
        sampling = self.sampling(cfg.eval.samples, cfg.eval.temperature, seed=12345)
        result = evaluate(
            self.pool,
            self.tokenizer,
            self.eval_items,
            reward_fn,
            cfg.eval.samples,
            sampling,
            instruction=instruction_text(cfg),
            details=True,
        )
        log.info("eval (%s, step %d): %s", label, self.step, _fmt(result))
        return result

    def run(self) -> dict:
        """Train to `run.steps` (or until a signal), then evaluate, plot and summarize."""
        cfg = self.config
        self._install_signal_handlers()
        try:
            self.setup()
            summary: dict = {}
            if self.step == 0:
                summary["eval_before"] = self.evaluate("before")
                if self.exporter is not None:
                    self.exporter.observe_step(0, _prefixed("eval/", summary["eval_before"]))
            self.metrics.truncate_after(self.step)
            while self.step < cfg.run.steps and not self.stop_requested:
                self._log_step(self.train_step())
                if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0:
                    self.save_checkpoint()
            self.finish_rollouts()
            if self.checkpointed_step != self.step:  # the periodic save may have just run
                self.save_checkpoint()
            if self.stop_requested:
                log.warning("stopped by signal at step %d; checkpoint written", self.step)
                summary["stopped_at"] = self.step
            else:
                summary["eval_after"] = self.evaluate("after")
            summary["final_step"] = self.step
            records = read_metrics(self.metrics.path)
            plot_run(records, self.run_dir / "plots")
            write_summary(records, self.run_dir / "summary.json", summary)
            return summary
        finally:
            self.close()

    def _log_step(self, metrics: dict) -> None:
        cfg = self.config
        if cfg.run.eval_every and self.step % cfg.run.eval_every == 0:
            metrics.update(_prefixed("eval/", self.evaluate(f"step {self.step}")))
        if self.exporter is not None:
            self.exporter.observe_step(self.step, metrics)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.metrics.write({"step": self.step, **scalars})
        log.info("step %d/%d %s", self.step, cfg.run.steps, _progress_line(metrics))

    def finish_rollouts(self) -> None:
        """Bring rollouts still in flight home before the final checkpoint (none in sync)."""

    def extra_state(self) -> dict:
        """More trainer state for checkpoints (the async trainer's pending prompts)."""
        return {}

    def restore_extra_state(self, state: dict) -> None:
        """Counterpart of `extra_state` on resume."""

    def close(self) -> None:
        """Stop the exporter and the run's actors (the Ray cluster itself stays up)."""
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        learners = getattr(self, "learners", None)
        if learners is not None:
            learners.shutdown()
        for actor in getattr(self, "generators", []) + [getattr(self, "reward_pool", None)]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.generators, self.reward_pool, self.learners = [], None, None

    # ------------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> Path:
        path = self.ckpt_root / f"step_{self.step:06d}"
        state = {
            "step": self.step,
            "cursor": self.cursor,
            "policy_version": self.policy_version,
            **self.extra_state(),
        }
        self.learners.save_checkpoint(str(path / "learner"), state)
        self.buffer.dump_parquet(path / "buffer.parquet")
        (path / STATE_FILE).write_text(json.dumps(state))
        (self.ckpt_root / "latest").write_text(path.name)
        self.checkpointed_step = self.step
        for old in sorted(self.ckpt_root.glob("step_*"))[: -self.config.run.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s", path)
        return path

    def _load_latest_checkpoint(self) -> None:
        latest = self.ckpt_root / "latest"
        if not latest.exists():
            log.info("no checkpoint under %s; starting from step 0", self.ckpt_root)
            return
        path = self.ckpt_root / latest.read_text().strip()
        state = json.loads((path / STATE_FILE).read_text())
        self.learners.load_checkpoint(str(path / "learner"))
        import pyarrow.parquet as pq

        self.buffer.load_table(pq.read_table(path / "buffer.parquet"))
        self.step, self.cursor = state["step"], state["cursor"]
        self.checkpointed_step = self.step
        self.policy_version = state["policy_version"]
        self.restore_extra_state(state)
        log.info("resumed from %s (step %d, data cursor %d)", path, self.step, self.cursor)

    # --------------------------------------------------------------------- plumbing

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            log.warning("signal %d: finishing this step, then checkpointing", signum)
            self.stop_requested = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_stop)

    def _wait(self, refs: list, what: str) -> list:
        """ray.get that logs, every `wait_warn_s`, what it is still waiting for."""
        pending = list(refs)
        start = time.monotonic()
        while pending:
            _, pending = ray.wait(
                pending, num_returns=len(pending), timeout=self.config.run.wait_warn_s
            )
            if pending:
                log.warning(
                    "still waiting for %s after %.0f s (%d of %d outstanding)",
                    what,
                    time.monotonic() - start,
                    len(pending),
                    len(refs),
                )
        return ray.get(refs)


def make_trainer(config: Config, resume: bool = False) -> Trainer:
    """The trainer for `run.mode`: `Trainer` (sync) or `AsyncTrainer` (async)."""
    if config.run.mode == "async":
        from cagrpo_ray.async_trainer import AsyncTrainer

        return AsyncTrainer(config, resume=resume)
    return Trainer(config, resume=resume)


class _RemoteRewardFunction:
    """The reward pool actor as a plain callable, for the evaluation harness."""

    def __init__(self, actor):
        self.actor = actor

    def __call__(self, responses, items):
        return ray.get(self.actor.__call__.remote(responses, items))


def _prefixed(prefix: str, values: dict) -> dict:
    return {prefix + k: v for k, v in values.items() if isinstance(v, int | float)}


def _fmt(result: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in result.items() if isinstance(v, float))


def _progress_line(m: dict) -> str:
    keys = [
        ("reward/mean", "reward"),
        ("accuracy/train", "acc"),
        ("entropy/mean", "entropy"),
        ("response/length_mean", "len"),
        ("time/step", "s/step"),
        ("throughput/generated_tokens_per_s", "gen tok/s"),
    ]
    return " ".join(f"{short}={m[k]:.3g}" for k, short in keys if k in m)
