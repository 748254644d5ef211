"""Asynchronous training: the generators never wait for the learner.

The driver is one event loop over Ray object refs. Every generator replica always has a
chunk of prompts in flight (while there is admissible work); a finished chunk goes to the
reward pool; a scored group goes into the rollout buffer; as soon as the buffer holds a batch,
the learner trains on it while generation goes on; when the learner step ends, the new weights
are broadcast, and each replica loads them between two of its requests (its `receive_weights`
call is queued behind the chunk it is generating, so no request is ever cut in half):

    generator 0  |== chunk ==|== chunk ==|rw|== chunk ==|== chunk ==|rw| ...
    generator 1  |== chunk ==|== chunk ==|== chunk ==|rw|== chunk ==| ...
    reward pool        |s|         |s|       |s|           |s|
    learner      |------ train v ------|send|------ train v+1 ------|send| ...

Bounded staleness. A sample's staleness is the learner version that trains on it minus the
version that sampled it. With P prompts per step and bound s, a chunk is only *started* when

    outstanding + chunk <= (g + s + 1 - t) * P                                        (1)

where g is the version the replica will sample with, t the version that will train on the
next batch taken from the buffer (the learner's version, plus one while a step is running),
and `outstanding` counts groups buffered or in flight. So data that would be too stale is
never generated, and s = 0 gives the synchronous schedule (generate a batch, train, sync).
Groups that exceed the bound anyway (work requeued after a generator crash, a resumed
buffer) are dropped by the buffer when the batch is taken and counted in
`buffer/dropped_stale_groups`.

Off-policy correction is the learner's (see `Learner._tis_weights`): the PPO ratio is taken
against the proximal policy recomputed by the learner, and the behavior-to-proximal importance
weight is truncated at `algorithm.tis_cap`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import numpy as np
import pyarrow as pa
import ray
import torch
from ray.exceptions import RayActorError, RayError

from cagrpo_ray.algo.advantages import group_advantages
from cagrpo_ray.config import Config
from cagrpo_ray.data.prompts import format_prompt
from cagrpo_ray.rollout.buffer import group_record_batch, to_learner_batch
from cagrpo_ray.rollout.pool import _chunk_sampling
from cagrpo_ray.trainer import Trainer, _send_weights, idle_fraction, instruction_text

log = logging.getLogger("cagrpo_ray")


def admissible_groups(
    gen_version: int,
    train_version: int,
    outstanding: int,
    prompts_per_step: int,
    max_staleness: int,
) -> int:
    """How many more prompt groups may be started now under bound (1) of the module docstring."""
    budget = (gen_version + max_staleness + 1 - train_version) * prompts_per_step
    return max(0, budget - outstanding)


def rollout_metrics(table: pa.Table, group_size: int) -> dict:
    """Reward, accuracy and length statistics of a batch taken from the buffer."""
    rewards = table.column("reward").to_numpy()
    lengths = table.column("response_len").to_numpy()
    by_group = rewards.reshape(-1, group_size)
    return {
        "reward/mean": float(rewards.mean()),
        "accuracy/train": float(np.mean(table.column("correct").to_numpy(zero_copy_only=False))),
        "reward/equal_reward_groups": float(np.mean(np.ptp(by_group, axis=1) == 0)),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": float(
            np.mean(np.asarray(table.column("finish_reason").to_pylist()) == "length")
        ),
    }


@dataclasses.dataclass
class _Chunk:
    replica: int
    indices: list[int]  # prompt indices into the training source
    group_ids: list[int]
    version: int  # the weights the replica samples it with
    submitted: float


class AsyncTrainer(Trainer):
    """`Trainer` whose steps overlap generation, scoring, training and weight sync."""

    def __init__(self, config: Config, resume: bool = False):
        super().__init__(config, resume)
        self.max_staleness = config.run.max_staleness
        self.requeue: deque[int] = deque()  # prompt indices to generate before new ones
        self.next_group_id = 0
        self.gen_refs: dict = {}  # ObjectRef -> _Chunk
        self.reward_refs: dict = {}  # ObjectRef -> (_Chunk, completions per prompt)
        self.learn_refs: list = []
        self.sync_refs: list = []
        self.sync_version = 0
        self.sync_started = 0.0
        self.last_sync: dict = {}
        self.replica_version: list[int] = []  # what each replica samples with next
        self.tokens_generated = 0.0
        self.verifier_errors = 0

    def setup(self) -> None:
        super().setup()
        self.replica_version = [self.policy_version] * len(self.generators)
        self.instruction = instruction_text(self.config)

    # ------------------------------------------------------------------- the loop

    def train_step(self) -> dict:
        cfg = self.config
        P = cfg.rollout.prompts_per_step
        t_start = time.perf_counter()
        busy_before, tokens_before = sum(self.pool.busy_seconds), self.tokens_generated
        errors_before, dropped_before = self.verifier_errors, self.buffer.dropped_stale

        # (1) Wait for a batch within the staleness bound (generation goes on meanwhile).
        min_version = self.policy_version - self.max_staleness
        while True:
            self.buffer.drop_stale(min_version)
            if len(self.buffer) >= P:
                break
            self._pump()
        # Groups arrive in completion order; the learner sees them in the order they were
        # started, so the batch does not depend on which replica finished first.
        table = self.buffer.take(P, min_version=min_version).sort_by("group_id")
        t_batch = time.perf_counter()

        # (2) Train on it; the learner runs its pending weight send first (actor order).
        batch = to_learner_batch(table, pad_token_id=self.tokenizer.pad_token_id)
        staleness = self.policy_version - batch["policy_version"]
        self.learn_refs = self.learners.submit_train_step(batch)
        while not _all_done(self.learn_refs):
            self._pump(wait_on=self.learn_refs)
        learner_metrics = self.learners.collect(self.learn_refs, "train_step")[0]
        self.learn_refs = []
        t_trained = time.perf_counter()
        self.step += 1
        self.policy_version = self.step

        # (3) Broadcast the new weights; replicas load them between requests.
        self._finish_sync()  # the previous broadcast (normally long done)
        sync_metrics = dict(self.last_sync)
        if self.pool.needs_weights:
            self._full_resync()  # a replica restarted or a broadcast failed
        else:
            self._start_sync(self.policy_version)
        self._dispatch()
        step_time = time.perf_counter() - t_start

        metrics = rollout_metrics(table, cfg.rollout.group_size)
        metrics.update(
            {f"learner/{k}" if "/" not in k else k: v for k, v in learner_metrics.items()}
        )
        trained_tokens = float(batch["response_mask"].sum())
        generated = self.tokens_generated - tokens_before
        metrics.update(
            {
                "reward/verifier_errors": self.verifier_errors - errors_before,
                "time/wait_batch": t_batch - t_start,
                "time/train": t_trained - t_batch,
                "time/sync": sync_metrics.get("sync/seconds", 0.0),
                "time/step": step_time,
                **sync_metrics,
                "throughput/generated_tokens_per_s": generated / step_time,
                "throughput/trained_tokens_per_s": trained_tokens / max(t_trained - t_batch, 1e-9),
                "throughput/samples_per_s": len(batch["rewards"]) / step_time,
                "buffer/depth_groups": len(self.buffer),
                "buffer/dropped_stale_groups": self.buffer.dropped_stale,
                "buffer/dropped_this_step": self.buffer.dropped_stale - dropped_before,
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

    def _outstanding(self) -> int:
        """Groups not yet taken by the learner: buffered, being scored, being generated."""
        in_flight = sum(len(c.indices) for c in self.gen_refs.values())
        scoring = sum(len(c.indices) for c, _ in self.reward_refs.values())
        return len(self.buffer) + in_flight + scoring

    def _dispatch(self) -> None:
        """Give every idle replica a chunk, as far as the staleness bound (1) admits."""
        cfg = self.config
        if self.pool.needs_weights and not self.learn_refs:
            self._full_resync()  # only while the learner is idle: its weights are policy_version
        busy = {c.replica for c in self.gen_refs.values()}
        train_version = self.policy_version + (1 if self.learn_refs else 0)
        for replica in range(len(self.generators)):
            if replica in busy or replica in self.pool.needs_weights:
                continue
            room = admissible_groups(
                self.replica_version[replica],
                train_version,
                self._outstanding(),
                cfg.rollout.prompts_per_step,
                self.max_staleness,
            )
            count = min(cfg.rollout.chunk_prompts, room)
            if count == 0:
                continue
            indices = [self._next_index() for _ in range(count)]
            group_ids = list(range(self.next_group_id, self.next_group_id + count))
            self.next_group_id += count
            prompts = [
                format_prompt(self.tokenizer, self.train_source[i].question, self.instruction)
                for i in indices
            ]
            # The seeds of the synchronous trainer for the same groups: with max_staleness 0
            # an async run samples, and so trains, exactly what a sync run does.
            step, start = divmod(group_ids[0], cfg.rollout.prompts_per_step)
            seed = cfg.run.seed * 1_000_003 + step
            base = self.sampling(cfg.rollout.group_size, cfg.rollout.temperature, seed)
            sampling = _chunk_sampling(base, start)
            ref = self.generators[replica].generate.remote(prompts, sampling)
            self.gen_refs[ref] = _Chunk(
                replica, indices, group_ids, self.replica_version[replica], time.monotonic()
            )

    def _next_index(self) -> int:
        if self.requeue:
            return self.requeue.popleft()
        if self.cursor >= len(self.train_source):
            self.cursor = 0  # a new epoch over the same prompts, in the same order
        index = self.cursor
        self.cursor += 1
        return index

    def _pump(self, wait_on: list | None = None) -> None:
        """Dispatch work, then handle whatever finishes first (or `wait_on`'s refs)."""
        self._dispatch()
        refs = list(self.gen_refs) + list(self.reward_refs)
        refs += _pending(wait_on or []) + _pending(self.sync_refs)
        if not refs and wait_on:
            return  # what the caller waits for finished since it last looked
        if not refs:
            raise RuntimeError(
                "nothing in flight and no batch buffered: the staleness bound admits no "
                "generation (is rollout.prompts_per_step larger than what can be buffered?)"
            )
        done, _ = ray.wait(refs, num_returns=1, timeout=self.config.run.wait_warn_s)
        if not done:
            log.warning(
                "waited %.0f s: %d chunks generating, %d being scored, learner %s",
                self.config.run.wait_warn_s,
                len(self.gen_refs),
                len(self.reward_refs),
                "training" if self.learn_refs else "idle",
            )
            return
        ref = done[0]
        if ref in self.gen_refs:
            self._on_generated(ref)
        elif ref in self.reward_refs:
            self._on_scored(ref)
        elif ref in self.sync_refs and not _pending(self.sync_refs):
            self._finish_sync()

    def _on_generated(self, ref) -> None:
        chunk = self.gen_refs.pop(ref)
        try:
            groups = ray.get(ref)
        except RayActorError as exc:
            log.warning("generator replica %d died (%s); its chunk is requeued", chunk.replica, exc)
            self._lost(chunk)
            return
        # chunk submitted -> returned, as the synchronous pool counts it
        self.pool.busy_seconds[chunk.replica] += time.monotonic() - chunk.submitted
        versions = {c.policy_version for group in groups for c in group}
        if versions and min(versions) < chunk.version:
            # Restarted since we last called it (Ray queues calls during a restart): it
            # answered with its initial weights.
            log.warning(
                "generator replica %d answered with policy versions %s, expected >= %d; "
                "resyncing it",
                chunk.replica,
                sorted(versions),
                chunk.version,
            )
            self._lost(chunk)
            return
        items = [self.train_source[i] for i in chunk.indices]
        texts = [c.text for group in groups for c in group]
        per_sample = [it for it in items for _ in range(self.config.rollout.group_size)]
        self.tokens_generated += sum(len(c.token_ids) for group in groups for c in group)
        self.reward_refs[self.reward_pool.__call__.remote(texts, per_sample)] = (chunk, groups)

    def _lost(self, chunk: _Chunk) -> None:
        self.pool.restarts += 1
        self.pool.needs_weights.add(chunk.replica)
        self.requeue.extendleft(reversed(chunk.indices))

    def _on_scored(self, ref) -> None:
        chunk, groups = self.reward_refs.pop(ref)
        results = self._wait([ref], "verifiers")[0]
        g = self.config.rollout.group_size
        rewards = np.array([r.reward for r in results], dtype=np.float32)
        correct = [r.correct for r in results]
        self.verifier_errors += sum(r.error is not None for r in results)
        advantages = group_advantages(
            torch.from_numpy(rewards), g, std_normalize=self.config.algorithm.std_normalize
        ).numpy()
        for k, (index, group_id, group) in enumerate(
            zip(chunk.indices, chunk.group_ids, groups, strict=True)
        ):
            sl = slice(k * g, (k + 1) * g)
            self.buffer.add(
                group_record_batch(
                    self.train_source[index].uid,
                    group_id,
                    group,
                    rewards[sl].tolist(),
                    correct[sl],
                    advantages[sl].tolist(),
                )
            )

    # ---------------------------------------------------------------- weight sync

    def _start_sync(self, version: int) -> None:
        """Queue `receive_weights(version)` behind each replica's chunk and start the send."""
        self.sync_version, self.sync_started = version, time.perf_counter()
        receives = [g.receive_weights.remote(version) for g in self.generators]
        sends = self.learners.submit_foreach_learner(_send_weights, version)
        self.sync_refs = receives + sends
        self.replica_version = [version] * len(self.generators)

    def _finish_sync(self) -> None:
        """Wait for the broadcast in flight. A failure marks every replica for a full resync,
        which `_full_resync` does once the learner is idle (its weights are then exactly
        `policy_version`)."""
        if not self.sync_refs:
            return
        refs, self.sync_refs = self.sync_refs, []
        n = len(self.generators)
        problems = []
        for replica, ref in enumerate(refs[:n]):
            try:
                self._wait([ref], f"generator {replica} to load weights v{self.sync_version}")
            except RayError as exc:
                problems.append(f"generator {replica}: {type(exc).__name__}: {exc}")
        sent = self.learners.collect(refs[n:], "weight send")[0]
        if "error" in sent:
            problems.append(f"learner: {sent['error']}")
        if problems:
            log.warning(
                "weight sync v%d failed (%s); every replica will be resynced",
                self.sync_version,
                "; ".join(p[:300] for p in problems),
            )
            self.pool.needs_weights.update(range(n))
            return
        self.last_sync = {
            "sync/seconds": time.perf_counter() - self.sync_started,
            "sync/bytes": sent["num_bytes"],
        }
        self.pool.policy_version = self.sync_version

    def _full_resync(self) -> None:
        """Rebuild the sync group and load `policy_version` everywhere (learner idle)."""
        self._finish_sync()
        self._drain_generation()
        log.warning("resyncing generator replicas %s", sorted(self.pool.needs_weights))
        self._await_generators()
        self._build_sync_group()
        self.last_sync = self.sync_weights()
        self.pool.needs_weights.clear()
        self.replica_version = [self.policy_version] * len(self.generators)

    def _drain_generation(self) -> None:
        """Let every chunk in flight finish (results are kept), so collectives can start."""
        while self.gen_refs:
            ref = next(iter(self.gen_refs))
            ray.wait([ref], timeout=None)
            self._on_generated(ref)

    # ------------------------------------------------------------- run boundaries

    def finish_rollouts(self) -> None:
        """Generation and scoring in flight land in the buffer; the last sync completes."""
        while self.gen_refs or self.reward_refs:
            refs = list(self.gen_refs) + list(self.reward_refs)
            done, _ = ray.wait(refs, num_returns=1)
            if done[0] in self.gen_refs:
                self._on_generated(done[0])
            else:
                self._on_scored(done[0])
        self._finish_sync()

    def evaluate(self, label: str) -> dict:
        if self.gen_refs or self.reward_refs or self.sync_refs:
            self.finish_rollouts()
        return super().evaluate(label)

    def extra_state(self) -> dict:
        """Prompts started but not yet buffered go first after a resume."""
        pending = [i for c in self.gen_refs.values() for i in c.indices]
        pending += [i for c, _ in self.reward_refs.values() for i in c.indices]
        return {"requeue": list(self.requeue) + pending, "next_group_id": self.next_group_id}

    def restore_extra_state(self, state: dict) -> None:
        self.requeue = deque(state.get("requeue", []))
        self.next_group_id = state.get(
            "next_group_id", self.step * self.config.rollout.prompts_per_step
        )


def _pending(refs: list) -> list:
    """The refs of `refs` that are not finished yet."""
    if not refs:
        return []
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    return pending


def _all_done(refs: list) -> bool:
    return not _pending(refs)
