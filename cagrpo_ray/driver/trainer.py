"""One training run from start to end: build the roles, evaluate, train, checkpoint, report.

`Trainer` has the roles started from a `Config` (`roles.build_roles`: each a plain class that
Ray wraps) and hands them to the one `TrainingLoop`, which runs the steps (its bound
`run.max_staleness` decides how far generation runs ahead of training; 0 is the synchronous
schedule):

    prompts ─> GeneratorPool (G samples each) ─> reward pool ─> RolloutBuffer
            ─> LearnerGroup.train_step ─> WeightSyncCoordinator (learner rank 0 ─> replicas)

A run directory holds `metrics.jsonl`, `checkpoints/step_NNNNNN/` (learner state; the
schedule's state: step, data cursor, prompts in flight, and its buffered rollouts; the policy
as a Hugging Face directory), `policy/` (the final policy, loadable by transformers, vLLM and
`python -m cagrpo_ray.eval --model`; under LoRA the adapter merged in), `adapter/` (under
LoRA: the adapter in PEFT's format), end-of-run plots and `summary.json` (with the step-0
evaluation, kept in `eval_before.json` for a run that resumes).

A learner rank lost during the run is recovered inside it, from the latest checkpoint, with
the generators kept up (`_recover_learners`), at most `run.max_restarts` times.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import time
from pathlib import Path

import numpy as np
import ray

from cagrpo_ray.checkpoints import latest_checkpoint, write_checkpoint
from cagrpo_ray.config import Config
from cagrpo_ray.console import log_dir
from cagrpo_ray.data.prompts import prompt_preamble
from cagrpo_ray.driver.loop import TrainingLoop, sampling_config
from cagrpo_ray.driver.roles import Roles, build_roles
from cagrpo_ray.learner.group import LearnerGroupError
from cagrpo_ray.learner.restarts import LearnerRestarts
from cagrpo_ray.metrics.jsonl import MetricsLog, read_metrics
from cagrpo_ray.metrics.plots import plot_run, summarize
from cagrpo_ray.metrics.trackers import Trackers
from cagrpo_ray.placement import Placement
from cagrpo_ray.rewards.errors import ERRORS_FILE, RewardErrorLog
from cagrpo_ray.rollout.kept import KeptGenerators
from cagrpo_ray.rollout.pool import GeneratorPool
from cagrpo_ray.sync.coordinator import WeightSyncCoordinator

log = logging.getLogger("cagrpo_ray")

POLICY_DIR = "policy"
ADAPTER_DIR = "adapter"
EVAL_BEFORE_FILE = "eval_before.json"  # the step-0 evaluation, for the summary of a resumed run
EVAL_SEED = 12345


def required_cpus(config: Config) -> float:
    """Ray CPUs that the run's actors ask for (a local cluster gets at least this many)."""
    r, lcfg = config.rollout, config.learner
    return (
        r.num_generators * r.num_cpus_per_generator
        + lcfg.num_learners * lcfg.num_cpus_per_learner
        + config.reward.num_cpus
    )


class Trainer:
    """Runs one training job described by `config`; `run()` returns the final summary.

    `kept_generators` (a `KeptGenerators`): the generator replicas are taken from it when it
    holds replicas started as this run would start them, and else started and left in it
    when the run ends, for the next run to take (`rollout/kept.py`); its owner ends them."""

    def __init__(
        self, config: Config, resume: bool = False, kept_generators: KeptGenerators | None = None
    ):
        self.config = config
        self.kept_generators = kept_generators
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.ckpt_root = self.run_dir / "checkpoints"
        self.log_dir = log_dir(self.run_dir)  # each actor's output: generator-0.log, ...
        self.resume = resume
        self.loop: TrainingLoop | None = None
        self.checkpointed_step: int | None = None  # step of the newest checkpoint on disk
        self.stop_requested = False
        self.stop_signal: int | None = None  # the signal that stopped the run, if one did
        self.learner_restarts = LearnerRestarts(config.run.max_restarts)  # recoveries so far
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.exporter = None
        self.trackers = Trackers([])  # metrics.loggers: W&B, MLflow, TensorBoard
        self.inspector = None  # the live token inspector's server
        self.roles = Roles()  # the actors: verifiers, placement, generator pool, learners

    # the roles, as `build_roles` starts them (and a recovery replaces the learners)
    @property
    def pool(self) -> GeneratorPool | None:
        return self.roles.pool

    @pool.setter
    def pool(self, pool: GeneratorPool | None) -> None:
        self.roles.pool = pool

    @property
    def learners(self):
        return self.roles.learners

    @learners.setter
    def learners(self, learners) -> None:
        self.roles.learners = learners

    @property
    def placement(self) -> Placement | None:
        return self.roles.placement

    @property
    def reward_pool(self):
        return self.roles.reward_pool

    @property
    def step(self) -> int:
        return self.loop.step if self.loop is not None else 0

    # ------------------------------------------------------------------------ set-up

    def setup(self) -> None:
        from transformers import AutoTokenizer

        from cagrpo_ray.policies.build import resolve_policy

        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        self.trackers = Trackers.start(cfg, self.run_dir, self.resume)  # first: one may fail
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed)

        self.model_path = str(
            resolve_policy(cfg.model.path, cfg.model.download_dir, cfg.model.gguf_file)
        )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.train_source, self.eval_items = self._sources()
        self.hard_items = self._hard_items()
        log.info(
            "policy %s; %d training prompts, %d held-out prompts",
            self.model_path,
            len(self.train_source),
            len(self.eval_items),
        )

        build_roles(
            cfg, self.model_path, self.log_dir, self.kept_generators, self._learner_group,
            self._wait, self.roles,
        )  # fmt: skip
        self.loop = self._new_loop()
        if cfg.metrics.enabled:
            from cagrpo_ray.metrics.prometheus import PrometheusExporter

            self.exporter = PrometheusExporter(cfg.run.name, cfg.metrics.port, cfg.metrics.host)
            self.exporter.start()
            log.info("metrics for Prometheus at %s", self.exporter.url)
        if cfg.metrics.inspect_every and cfg.metrics.inspect_port is not None:
            from cagrpo_ray.inspect import InspectorServer

            self.inspector = InspectorServer(
                self.run_dir, host=cfg.metrics.inspect_host, port=cfg.metrics.inspect_port
            ).start()
            log.info("token inspector at %s (the newest inspected step)", self.inspector.url)
        if self.resume:
            self._load_latest_checkpoint()
        self.loop.start()

    def _learner_group(self):
        """The learner ranks, each with the initial policy (`LearnerGroup`)."""
        from cagrpo_ray.learner.group import LearnerGroup
        from cagrpo_ray.learner.settings import learner_settings, loss_spec

        cfg = self.config
        return LearnerGroup(
            cfg.learner.num_learners,
            learner_settings(cfg, self.model_path),
            loss_spec(cfg),
            actor_options=[self.placement.learner(r) for r in range(cfg.learner.num_learners)],
            log_dir=self.log_dir,
            shard_by=cfg.learner.shard_by,
        )

    def _new_loop(self) -> TrainingLoop:
        """The schedule at step 0 over the run's roles, with a weight-sync coordinator from
        `self.learners` to the generator pool (the sync group is formed by its `start()`)."""
        cfg = self.config
        coordinator = WeightSyncCoordinator(
            self.learners,
            self.pool,
            cfg.rollout.tensor_parallel_size,
            cfg.sync.backend,
            cfg.sync.timeout_s,
            cfg.sync.bucket_mb,
            self._wait,
        )
        inspect = self.run_dir if cfg.metrics.inspect_every else None
        errors = RewardErrorLog(self.log_dir / ERRORS_FILE)
        return TrainingLoop(
            cfg, self.tokenizer, self.train_source, self.pool, self.reward_pool,
            self.learners, coordinator, self._wait, inspect_dir=inspect, reward_errors=errors,
        )  # fmt: skip

    def _sources(self):
        from cagrpo_ray.data.files import file_sources
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
        return file_sources(d, self.tokenizer, self.config.rollout.max_model_len)

    def _hard_items(self) -> list:
        """The harder held-out split (eval.hard_config), or [] when there is none. Its config
        differs from training's, so no training question can be among them."""
        from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource

        d, e = self.config.data, self.config.eval
        if not e.hard_config:
            return []
        config = {**d.dataset_config, **e.hard_config}
        return list(ReasoningGymSource(d.dataset, config, d.seed, e.hard_size, "eval").iter_from(0))

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

    # --------------------------------------------------------------------- the run

    def evaluate(self, label: str | None = None) -> dict:
        """The held-out prompts at eval.temperature (with per-prompt details), then at each of
        eval.temperatures (`T<t>/` metrics) and the harder split likewise (`hard/`). `label`
        ("before", "after") goes in the log line beside the step."""
        from cagrpo_ray.eval import evaluate
        from cagrpo_ray.rewards.verifiers import answer_extractor

        cfg = self.config
        reward_fn = _RemoteRewardFunction(self.reward_pool)
        engine = _PoolEngine(self.pool, self.loop)

        def at(items, temperature: float, details: bool) -> dict:
            samples = 1 if temperature == 0 else cfg.eval.samples  # greedy: one answer
            sampling = sampling_config(cfg.rollout, samples, temperature, seed=EVAL_SEED)
            return evaluate(engine, self.tokenizer, items, reward_fn, samples, sampling,
                            instruction=prompt_preamble(cfg.data), details=details,
                            extract_answer=answer_extractor(cfg.reward.weights),
                            multi_turn=cfg.rollout.max_turns > 1)  # fmt: skip

        result = at(self.eval_items, cfg.eval.temperature, True)
        sets = [("", self.eval_items)] + ([("hard/", self.hard_items)] if self.hard_items else [])
        for prefix, items in sets:
            if prefix:
                result.update(_prefixed(prefix, at(items, cfg.eval.temperature, False)))
            for t in cfg.eval.temperatures:
                result.update(_prefixed(f"{prefix}T{t:g}/", at(items, t, False)))
        where = f"{label}, step {self.step}" if label else f"step {self.step}"
        log.info("eval (%s): %s", where, _fmt(result))
        return result

    def run(self) -> dict:
        """Train to `run.steps` (or until a signal), then evaluate, plot and summarize."""
        cfg = self.config
        self._install_signal_handlers()
        try:
            self.setup()
            summary: dict = {}
            before = self.run_dir / EVAL_BEFORE_FILE
            if self.step == 0:
                summary["eval_before"] = self.evaluate("before")
                before.write_text(json.dumps(summary["eval_before"]))
                if self.exporter is not None:
                    self.exporter.observe_step(0, _prefixed("eval/", summary["eval_before"]))
            elif before.exists():  # resumed: the run's summary still starts from step 0
                summary["eval_before"] = json.loads(before.read_text())
            self.metrics.truncate_after(self.step)
            self._train()
            if self.stop_requested:
                log.warning("stopped by signal at step %d; checkpoint written", self.step)
                summary["stopped_at"] = self.step
                summary["stop_signal"] = self.stop_signal
            else:
                summary["eval_after"] = self.evaluate("after")
            if cfg.run.save_policy != "never":
                summary["policy_dir"] = self.learners.save_hf(str(self.run_dir / POLICY_DIR))
                if cfg.model.lora.enabled:
                    adapter_dir = str(self.run_dir / ADAPTER_DIR)
                    summary["adapter_dir"] = self.learners.save_adapter(adapter_dir)
            summary["final_step"] = self.step
            summary["run_dir"] = str(self.run_dir)
            if cfg.metrics.inspect_every:
                summary["inspect_dir"] = str(self.run_dir / "inspect")
            records = read_metrics(self.metrics.path)
            plot_run(records, self.run_dir / "plots", summary)
            summary = self.trackers.finish(summarize(records, summary))
            summary["nodes"] = self.roles.nodes  # where each actor ran (its node's address)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary
        finally:
            self.close()

    def _train(self) -> None:
        """Train to `run.steps` (or until a signal) and checkpoint the last step; a learner
        rank lost on the way is recovered (`_recover_learners`) as often as the run allows."""
        cfg = self.config
        lost: LearnerGroupError | None = None
        while True:
            try:
                if lost is not None:
                    self._recover_learners(lost)
                    lost = None
                while self.step < cfg.run.steps and not self.stop_requested:
                    self._log_step(self.loop.train_step())
                    if cfg.run.checkpoint_every and self.step % cfg.run.checkpoint_every == 0:
                        self.save_checkpoint()
                self.loop.finish_rollouts()
                if self.checkpointed_step != self.step:  # the periodic save may have just run
                    self.save_checkpoint()
                return
            except LearnerGroupError as error:  # the group is stopped; a new one may go on
                lost = error

    def _log_step(self, metrics: dict) -> None:
        cfg = self.config
        metrics["learner/restarts"] = self.learner_restarts.count
        if cfg.run.eval_every and self.step % cfg.run.eval_every == 0:
            metrics.update(_prefixed("eval/", self.evaluate()))
        if self.exporter is not None:
            self.exporter.observe_step(self.step, metrics)
        scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.metrics.write({"step": self.step, **scalars})
        self.trackers.log(self.step, scalars)
        log.info("step %d/%d %s", self.step, cfg.run.steps, _progress_line(metrics))

    def close(self) -> None:
        """Stop the exporter and the run's actors (the Ray cluster itself stays up), but for
        generator replicas that `kept_generators` holds."""
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.trackers.close(failed=True)  # a no-op once finish() has closed them
        if self.inspector is not None:
            self.inspector.close()
            self.inspector = None
        self.roles.close(keep_generators=self.kept_generators is not None)

    # ------------------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> Path:
        name = f"step_{self.step:06d}"
        # Written aside and published whole (`checkpoints.py`): a crash mid-write never
        # leaves a partial checkpoint as the latest.
        with write_checkpoint(self.ckpt_root, name, self.config.run.keep_checkpoints) as path:
            self.learners.save_checkpoint(str(path / "learner"))
            if self.config.run.save_policy == "checkpoints":
                self.learners.save_hf(str(path / POLICY_DIR))
            self.loop.save(path)
        path = self.ckpt_root / name
        self.checkpointed_step = self.step
        log.info("checkpoint %s", path)
        return path

    def _load_latest_checkpoint(self) -> None:
        path = latest_checkpoint(self.ckpt_root)  # the newest that verifies
        if path is None:
            log.info("no checkpoint under %s; starting from step 0", self.ckpt_root)
            return
        self.learners.load_checkpoint(str(path / "learner"))
        self.loop.load(path)
        self.checkpointed_step = self.step
        log.info("resumed from %s (step %d)", path, self.step)

    # ------------------------------------------------------------------------ faults

    def _recover_learners(self, lost: LearnerGroupError) -> None:
        """Go on after the learner group was stopped by `lost` (`learner/restarts.py`): a new
        group from the latest checkpoint that verifies (from the initial policy at step 0
        when there is none), the schedule and its data cursor rewound to it, and the
        generators, which stay up, joined to a new sync group and given its weights. What
        was generated since the checkpoint is dropped and the steps since it are trained
        again, the same way: the schedule is deterministic. Raises, leaving the checkpoints
        as they are, when the run must stop instead."""
        cfg, failed_at, kept = self.config, self.step, self.checkpointed_step
        self.learner_restarts.admit(lost, failed_at, None if kept is None else f"step_{kept:06d}")
        started = time.monotonic()
        log.error(
            "learner rank %s was lost after step %d; rebuilding the learner group from the latest "
            "checkpoint (recovery %d of at most %d): %s",
            lost.rank, failed_at, self.learner_restarts.count, cfg.run.max_restarts, lost,
        )  # fmt: skip
        # What the old schedule has in flight ends and is dropped: its weight sync (from a
        # sender that may be gone: each receive fails within sync.timeout_s) and the chunks
        # being generated. Scoring in flight finishes on its own; the old loop, which
        # alone waits for it, is dropped too.
        in_sync = self.loop.coordinator.pending()
        if in_sync:
            ray.wait(in_sync, num_returns=len(in_sync), timeout=cfg.sync.timeout_s)
        self.pool.drain()
        self.learners.shutdown()  # every rank: a DeepSpeed group cannot be repaired rank by rank
        self.learners = self._learner_group()
        self.loop = self._new_loop()
        self._load_latest_checkpoint()
        self.loop.start()  # a sync group with the live generators, and its weights
        self.metrics.truncate_after(self.step)
        log.warning(
            "learner group rebuilt in %.1f s; continuing from step %d (%d trained steps to "
            "repeat)", time.monotonic() - started, self.step, failed_at - self.step,
        )  # fmt: skip

    # --------------------------------------------------------------------- plumbing

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, _frame):
            log.warning("signal %d: finishing this step, then checkpointing", signum)
            self.stop_requested = True
            self.stop_signal = self.stop_signal or signum

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


class _PoolEngine:
    """The generator pool as the evaluation harness's engine, between training steps: what
    the run has in flight lands first, and a replica that needs weights is resynced by the
    loop (which knows the learner's version) before it serves."""

    def __init__(self, pool: GeneratorPool, loop: TrainingLoop):
        self.pool, self.loop = pool, loop

    def generate(self, prompts: list[list[int]], sampling):
        self.loop.finish_rollouts()
        return self.pool.generate(prompts, sampling, resync=self.loop.resync)


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
