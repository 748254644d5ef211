"""The Ray loop that runs the schedule: generation, scoring, training and weight sync,
overlapped as far as the staleness bound allows.

What is generated and trained, and when, is decided by `cagrpo_ray.schedule.Schedule` (a plain
state machine: the admission rule, requeues, the data cursor, versions, stale groups, batch
order). This module only feeds it: one event loop over Ray object refs, which hands chunks of
prompts to the generator replicas as the schedule admits them, many per replica at once (each
replica's engine batches every request it holds); sends a finished chunk to the reward pool;
scores it (`rollout/scoring.py`) and reports the groups to the schedule; trains the learners on
the batch the schedule gives while generation goes on; and, when the learner step ends,
broadcasts the new weights, which each replica loads between requests (it lets the requests in
flight finish and takes no new one until it has loaded, so no request is ever cut in half):

    generator 0  |== chunk ==|== chunk ==|rw|== chunk ==|== chunk ==|rw| ...
    generator 1  |== chunk ==|== chunk ==|== chunk ==|rw|== chunk ==| ...
    reward pool        |s|         |s|       |s|           |s|
    learner      |------ train v ------|send|------ train v+1 ------|send| ...

The bound and its inequality (1) are the schedule's docstring. Batches are taken in start
order (group-id order): the learner waits for a slow replica's group rather than train later
ones first, so no group exceeds the bound and none is dropped without a fault, and each
prompt started is trained once (or filtered by dynamic sampling). Off-policy correction is the
learner's (`algo/off_policy.py`): the PPO ratio is taken against the proximal policy recomputed
by the learner, and the behavior-to-proximal importance weight is truncated at
`algorithm.tis_cap`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from cagrpo_ray.algo.recipe import Recipe
from cagrpo_ray.config import Config
from cagrpo_ray.data.prompts import format_prompt, prompt_preamble
from cagrpo_ray.inspect.capture import capture_step, groups_to_inspect
from cagrpo_ray.rewards.errors import RewardErrorLog
from cagrpo_ray.rollout.batch_metrics import rollout_metrics
from cagrpo_ray.rollout.buffer import group_record_batch, to_learner_batch
from cagrpo_ray.rollout.pool import GeneratorPool, chunk_sampling
from cagrpo_ray.schedule import ChunkStart, Schedule, ScheduleSettings
from cagrpo_ray.sync.coordinator import WeightSyncCoordinator
from cagrpo_ray.types import SamplingConfig

log = logging.getLogger("cagrpo_ray")


def sampling_config(rollout, n: int, temperature: float, seed: int) -> SamplingConfig:
    """`n` samples a prompt at `temperature` with `seed`, under the config's `rollout` limits."""
    return SamplingConfig(
        n=n,
        temperature=temperature,
        max_tokens=rollout.max_tokens,
        seed=seed,
    )


def idle_fraction(busy_seconds: float, replicas: int, wall_seconds: float) -> float:
    """Share of the replicas' wall time in which none of their requests was running."""
    if replicas == 0 or wall_seconds <= 0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - busy_seconds / (replicas * wall_seconds))))


@dataclass(frozen=True)
class Counters:
    """The run's running totals, read at a learner step's start and end: the step's metrics of
    generation and scoring are their differences (`counter_metrics`)."""

    busy_seconds: float = 0.0  # the replicas' requests, summed
    tokens_generated: float = 0.0
    verifier_errors: int = 0
    unparsed: int = 0  # scored responses in which the task verifier found no answer
    scored_responses: int = 0
    components: tuple[tuple[str, float], ...] = ()  # reward functions' own components, summed
    spanning_loads: int = 0  # responses generated across a weight load (in-flight mode)
    overlong_penalized: int = 0
    dropped_stale: int = 0  # groups the schedule dropped as too stale
    filtered_groups: int = 0  # groups dynamic sampling filtered


def counter_metrics(
    before: Counters, after: Counters, step_seconds: float, replicas: int, in_flight: bool
) -> dict[str, float]:
    """A step's metrics of generation and scoring: what the totals grew by in the step, per
    scored response or per second of the step where a rate is meant (so runs compare whatever
    their staleness bound)."""
    scored = max(1, after.scored_responses - before.scored_responses)
    generated = after.tokens_generated - before.tokens_generated
    busy = after.busy_seconds - before.busy_seconds
    metrics = {
        "reward/verifier_errors": after.verifier_errors - before.verifier_errors,
        # of the responses scored since the last step (what generation produced)
        "reward/unparsed_fraction": (after.unparsed - before.unparsed) / scored,
        "throughput/generated_tokens_per_s": generated / step_seconds,
        "buffer/dropped_this_step": after.dropped_stale - before.dropped_stale,
        "dynamic_sampling/filtered_groups": after.filtered_groups - before.filtered_groups,
        "reward/overlong_penalized": after.overlong_penalized - before.overlong_penalized,
        "generators/idle_fraction": idle_fraction(busy, replicas, step_seconds),
        "tokens/generated": generated,
    }
    earlier = dict(before.components)
    for name, total in after.components:  # e.g. reward/gsm8k/strict_format
        metrics[f"reward/{name}"] = (total - earlier.get(name, 0.0)) / scored
    if in_flight:
        metrics["rollout/spanning_load_fraction"] = (
            after.spanning_loads - before.spanning_loads
        ) / scored
    return metrics


class TrainingLoop:
    """The training loop of one run: `train_step()` is one learner step; `save`/`load` keep
    its state in a checkpoint directory.

    The roles are built by the caller (`Trainer`): the generator `pool`, the `reward_pool`
    actor, the `learners`, the weight-sync `coordinator`; `wait(refs, what)` is a `ray.get`
    that logs long waits; `reward_errors` shows and keeps the reward errors (`rewards/errors.py`;
    default: the console only). The schedule (`self.schedule`) is built here from the config.
    """

    def __init__(
        self,
        config: Config,
        tokenizer,
        train_source,
        pool: GeneratorPool,
        reward_pool,
        learners,
        coordinator: WeightSyncCoordinator,
        wait,
        inspect_dir=None,
        reward_errors: RewardErrorLog | None = None,
    ):
        self.config = config
        self.tokenizer, self.train_source = tokenizer, train_source
        self.pool, self.reward_pool, self.learners = pool, reward_pool, learners
        self.coordinator = coordinator
        self._wait = wait
        self.inspect_dir = inspect_dir  # the run directory when steps are inspected
        self.reward_errors = reward_errors or RewardErrorLog(None)
        self.instruction = prompt_preamble(config.data)
        self.reward_refs: dict = {}  # ObjectRef -> (PromptChunk, completions per prompt)
        self.learn_refs: list = []
        self.tokens_generated = 0.0
        self.verifier_errors = 0
        self.unparsed = 0  # scored responses in which the task verifier found no answer
        self.scored_responses = 0
        self.component_sums: dict[str, float] = {}  # reward functions' own components, summed
        self.spanning_loads = 0  # responses generated across a weight load (in-flight mode)
        self.overlong_penalized = 0
        r = config.rollout
        self.recipe = Recipe(config.algorithm.recipe_spec(r.group_size, r.max_tokens))
        limit = self.recipe.groups_assessed_limit(r.prompts_per_step)
        self.schedule = Schedule(ScheduleSettings.from_config(config, len(train_source), limit))

    @property
    def step(self) -> int:
        """Learner steps trained: the learner's policy version."""
        return self.schedule.step

    # ------------------------------------------------------------------- state

    def save(self, directory) -> None:
        """The schedule's state, the buffered groups and the controllers' state (`algo/recipe.py`),
        into the checkpoint `directory` (taken with the learner idle)."""
        self.schedule.save(directory, {"controllers": self.recipe.state()})

    def load(self, directory) -> None:
        """Continue from what `save` wrote into `directory`."""
        state = self.schedule.load(directory)
        self.recipe.restore(state["controllers"])

    def start(self) -> None:
        """Form the weight-sync group and serve the learner's weights from the first step."""
        self.coordinator.build_group()
        self.coordinator.sync(self.step)

    # ------------------------------------------------------------------- the loop

    def train_step(self) -> dict:
        """One learner step: wait for a batch within the bound, train on it, start the sync."""
        cfg, schedule = self.config, self.schedule
        t_start = time.perf_counter()
        before = self.counters()

        # (1) Wait for a batch within the staleness bound (generation goes on meanwhile).
        while (taken := schedule.take_batch()) is None:
            self._pump()
        table = taken.table
        t_batch = time.perf_counter()

        # (2) Train on it; the learner runs its pending weight send first (actor order).
        batch = to_learner_batch(table, pad_token_id=self.tokenizer.pad_token_id)
        truncated = np.asarray(table.column("finish_reason").to_pylist()) == "length"
        batch["response_mask"] = self.recipe.token_mask(
            batch["response_mask"], torch.from_numpy(truncated)
        )
        batch["advantages"] = self.recipe.batch_advantages(
            batch["advantages"], batch["response_mask"]
        )
        staleness = schedule.step - batch["policy_version"]
        inspect = self._groups_to_inspect(batch)
        options = self.recipe.loss_options()
        self.learn_refs = self.learners.submit_train_step(batch, inspect, options)
        schedule.step_started()
        while self._pending(self.learn_refs):
            self._pump(wait_on=self.learn_refs)
        learner_metrics = self.learners.collect(self.learn_refs, "train_step")[0]
        self.learn_refs = []
        schedule.step_trained()
        # this step's loss options, then the next step's from its metrics
        learner_metrics.update(self.recipe.observe(learner_metrics))
        t_trained = time.perf_counter()
        if inspect:
            kept = self.learners.inspection()
            meta = {"step": self.step, "policy_loss": cfg.algorithm.policy_loss,
                    "cov_scope": cfg.algorithm.cov_scope, "run_name": cfg.run.name}  # fmt: skip
            capture_step(self.inspect_dir, self.step, table, batch, kept, self.tokenizer, meta)

        # (3) Broadcast the new weights; replicas load them between requests.
        self.coordinator.finish()  # the previous broadcast (normally long done)
        sync_metrics = dict(self.coordinator.last)
        if schedule.resync_due(bool(self.pool.needs_weights_now)):
            self.resync()  # a replica restarted or a broadcast failed
        else:
            self.coordinator.start(self.step)
        self._dispatch()
        self.reward_errors.step_done(self.step)
        step_time = time.perf_counter() - t_start

        metrics = rollout_metrics(table, cfg.rollout.group_size, cfg.rollout.max_turns > 1)
        metrics.update(
            {f"learner/{k}" if "/" not in k else k: v for k, v in learner_metrics.items()}
        )
        trained_tokens = float(batch["response_mask"].sum())
        metrics.update(
            {
                "time/wait_batch": t_batch - t_start,
                "time/train": t_trained - t_batch,
                "time/sync": sync_metrics.get("sync/seconds", 0.0),
                "time/step": step_time,
                **sync_metrics,
                "throughput/trained_tokens_per_s": trained_tokens / max(t_trained - t_batch, 1e-9),
                "throughput/samples_per_s": len(batch["rewards"]) / step_time,
                "buffer/depth_groups": schedule.buffered,
                "buffer/dropped_stale_groups": schedule.dropped_stale,
                "dynamic_sampling/scored_groups": taken.scored_groups,
                "staleness/mean": float(staleness.float().mean()),
                "staleness/max": int(staleness.max()),
                "staleness/values": staleness.numpy(),
                "generators/restarts": self.pool.restarts,
                "policy_version": self.step,
                "data/cursor": schedule.cursor,
            }
        )
        in_flight = cfg.rollout.weight_update == "in_flight"
        replicas = self.pool.num_replicas
        metrics.update(counter_metrics(before, self.counters(), step_time, replicas, in_flight))
        return metrics

    def counters(self) -> Counters:
        """The run's totals now (`Counters`)."""
        return Counters(
            busy_seconds=self.pool.busy_seconds,
            tokens_generated=self.tokens_generated,
            verifier_errors=self.verifier_errors,
            unparsed=self.unparsed,
            scored_responses=self.scored_responses,
            components=tuple(self.component_sums.items()),
            spanning_loads=self.spanning_loads,
            overlong_penalized=self.overlong_penalized,
            dropped_stale=self.schedule.dropped_stale,
            filtered_groups=self.schedule.filtered_groups,
        )

    def _groups_to_inspect(self, batch) -> list[int] | None:
        """The groups whose tokens the coming learner step keeps for the inspector, if any."""
        m = self.config.metrics
        if self.inspect_dir is None or not m.inspect_every or (self.step + 1) % m.inspect_every:
            return None
        return groups_to_inspect(batch["group_ids"].numpy(), m.inspect_groups, self.step + 1)

    def _dispatch(self) -> None:
        """Give replicas chunks, as far as the schedule admits them."""
        if self.schedule.resync_due(bool(self.pool.needs_weights_now)):
            self.resync()
        while (count := self.schedule.prompts_wanted()) > 0:
            replicas = self.pool.available_replicas(count)
            if not replicas:
                return
            replica = replicas[0]  # the least loaded
            start = self.schedule.start_chunk(count, self.pool.version(replica))
            if start is None:
                return
            self._submit(replica, start)

    def _submit(self, replica: int, start: ChunkStart) -> None:
        """Send the chunk the schedule started to `replica`, with its seeds."""
        r = self.config.rollout
        prompts = [
            format_prompt(self.tokenizer, self.train_source[i].question, self.instruction)
            for i in start.chunk.indices
        ]
        base = sampling_config(r, r.group_size, r.temperature, start.seed)
        self.pool.submit(replica, prompts, chunk_sampling(base, start.place), start.chunk)

    def _pump(self, wait_on: list | None = None) -> None:
        """Dispatch work, then handle whatever finishes first (or `wait_on`'s refs)."""
        refs = self._dispatch_then_waitable(wait_on)
        if not refs and wait_on:
            return  # what the caller waits for finished since it last looked
        if not refs:
            schedule = self.schedule
            raise RuntimeError(
                "nothing in flight and no batch buffered: the staleness bound admits no "
                "generation (is rollout.prompts_per_step larger than what can be buffered?). "
                f"Schedule: step {schedule.step}, training {schedule.training}, "
                f"{schedule.outstanding()} groups outstanding ({len(schedule.buffer)} buffered), "
                f"{schedule.prompts_wanted()} prompts wanted; pool: {self.pool.state()}"
            )
        done, _ = ray.wait(refs, num_returns=1, timeout=self.config.run.wait_warn_s)
        if not done:
            log.warning(
                "waited %.0f s: %d chunks generating, %d being scored, learner %s",
                self.config.run.wait_warn_s,
                len(self.pool.in_flight()),
                len(self.reward_refs),
                "training" if self.learn_refs else "idle",
            )
            return
        ref = done[0]
        if self.pool.owns(ref):
            self._on_generated(ref)
        elif ref in self.reward_refs:
            self._on_scored(ref)
        elif not self.coordinator.pending():
            self.coordinator.finish()

    def _dispatch_then_waitable(self, wait_on: list | None) -> list:
        """Dispatch work; then what `_pump` may wait for (`_waitable`), dispatching again
        while there is nothing to wait for and the dispatch may have met a weight load that
        finished while it ran:

        - a load that succeeded after the dispatch held the work for its replica, and before
          the refs were listed (so the sync is no longer pending);
        - a load that failed there (its replica died, or stayed on its old version, which the
          bound may not admit): the replica needs weights, and the dispatch resyncs it, the
          learner being idle (the sync's refs all resolved, nothing else is in flight)."""
        self._dispatch()
        refs = self._waitable(wait_on)
        if wait_on:
            return refs
        while not refs and (
            self.pool.loading or self.schedule.resync_due(bool(self.pool.needs_weights_now))
        ):
            self._dispatch()
            refs = self._waitable(wait_on)
        return refs

    def _waitable(self, wait_on: list | None) -> list:
        """What `_pump` may wait for: generation, scoring, `wait_on` and the sync in flight."""
        refs = self.pool.in_flight() + list(self.reward_refs)
        return refs + self._pending(wait_on or []) + self.coordinator.pending()

    def _on_generated(self, ref) -> None:
        self._handle_finished(self.pool.finish(ref))

    def _handle_finished(self, finished) -> None:
        """A chunk came back: score it, or requeue its prompts if its replica was lost."""
        chunk = finished.chunk.tag
        if finished.lost:
            self.schedule.chunk_lost(chunk)
            return
        items = [self.train_source[i] for i in chunk.indices]
        groups = finished.groups
        self.spanning_loads += sum(bool(c.loads) for group in groups for c in group)
        texts = [c.text for group in groups for c in group]
        per_sample = [it for it in items for _ in range(self.config.rollout.group_size)]
        self.tokens_generated += sum(len(c.token_ids) for group in groups for c in group)
        ids = [c.token_ids for group in groups for c in group]  # TRL-style reward functions
        self.reward_refs[self.reward_pool.__call__.remote(texts, per_sample, ids)] = (chunk, groups)

    def _on_scored(self, ref) -> None:
        """A chunk's verdicts came back: shape, estimate advantages, filter, and hand its
        groups (as record batches; None for a filtered one) to the schedule."""
        chunk, groups = self.reward_refs.pop(ref)
        results = self._wait([ref], "verifiers")[0]
        g = self.config.rollout.group_size
        self.verifier_errors += sum(r.error is not None for r in results)
        for k, result in enumerate(results):
            if result.error is not None:
                index, group, response = chunk.indices[k // g], k // g, k % g
                self.reward_errors.record(
                    self.schedule.step + 1,  # the learner step under way
                    result.error,
                    self.train_source[index].uid,
                    index,
                    chunk.group_ids[group],
                    response,
                    groups[group][response].text,
                )
        self.unparsed += sum(not r.parsed for r in results)
        self.scored_responses += len(results)
        for result in results:
            for name, value in result.components.items():
                if "/" in name:  # a reward function's dict: its keys besides the score
                    self.component_sums[name] = self.component_sums.get(name, 0.0) + value
        lengths = [len(c.token_ids) for group in groups for c in group]
        outcome = self.recipe.assess_groups([r.reward for r in results], lengths)
        correct = [bool(r.correct) for r in results]
        self.overlong_penalized += outcome.reshaped
        records = []
        for k, (index, group_id, group) in enumerate(
            zip(chunk.indices, chunk.group_ids, groups, strict=True)
        ):
            if not outcome.keep[k]:  # no signal: filtered (dynamic sampling)
                records.append(None)
                continue
            sl = slice(k * g, (k + 1) * g)
            records.append(
                group_record_batch(
                    self.train_source[index].uid,
                    group_id,
                    group,
                    outcome.rewards[sl].tolist(),
                    correct[sl],
                    outcome.advantages[sl].tolist(),
                )
            )
        self.schedule.chunk_scored(chunk, records)

    def resync(self) -> None:
        """Bring every live replica to the learner's version (learner idle): finish what is
        generating (results are kept), then rebuild the sync group from the live replicas and
        load the weights (a lost replica joins at the resync after Ray has restarted it)."""
        self.coordinator.finish()
        for finished in self.pool.drain():
            self._handle_finished(finished)
        self.coordinator.resync(self.step)

    # ------------------------------------------------------------- run boundaries

    def finish_rollouts(self) -> None:
        """Generation and scoring in flight land in the buffer; the last sync completes. After
        it nothing of the run is in flight: the pool may serve other requests (evaluation)."""
        while self.pool.in_flight() or self.reward_refs:
            refs = self.pool.in_flight() + list(self.reward_refs)
            done, _ = ray.wait(refs, num_returns=1)
            if self.pool.owns(done[0]):
                self._on_generated(done[0])
            else:
                self._on_scored(done[0])
        self.coordinator.finish()

    @staticmethod
    def _pending(refs: list) -> list:
        """The refs of `refs` that are not finished yet."""
        if not refs:
            return []
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        return pending
