"""One scheduler for every schedule: generation, scoring, training and weight sync, overlapped
as far as a staleness bound allows.

The driver is one event loop over Ray object refs. Chunks of prompts go to the generator
replicas as long as the bound admits more, many per replica at once (each replica's engine
batches every request it holds); a finished chunk goes to the reward pool; a scored group goes
into the rollout buffer with its advantages; as soon as the buffer holds a batch, the learner
trains on it while generation goes on; when the learner step ends, the new weights are
broadcast, and each replica loads them between requests (it lets the requests in flight finish
and takes no new one until it has loaded, so no request is ever cut in half):

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
never generated, and s = 0 is the synchronous schedule (generate a batch, score it, train,
sync, repeat: on-policy, the generators idle while the learner trains). Groups that exceed the
bound anyway (work requeued after a generator crash, a resumed buffer) are dropped by the
buffer when the batch is taken and counted in `buffer/dropped_stale_groups`.

Batches are taken in the order their groups were started, with seeds fixed by each group's
position (step, index in the step), so a run's samples do not depend on which replica finished
first, and s = 0 trains on exactly the batches of a strictly sequential loop.

Off-policy correction is the learner's (`algo/off_policy.py`): the PPO ratio is taken against
the proximal policy recomputed by the learner, and the behavior-to-proximal importance weight
is truncated at `algorithm.tis_cap`.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import ray
import torch

from cagrpo_ray.algo.controllers import KappaController
from cagrpo_ray.config import Config
from cagrpo_ray.data.prompts import format_prompt, prompt_preamble
from cagrpo_ray.inspect.capture import capture_step, groups_to_inspect
from cagrpo_ray.rollout.buffer import RolloutBuffer, group_record_batch, to_learner_batch
from cagrpo_ray.rollout.pool import GeneratorPool, chunk_sampling
from cagrpo_ray.rollout.requeue import PromptChunk, Requeue
from cagrpo_ray.rollout.scoring import rollout_metrics, score_groups
from cagrpo_ray.rollout.types import SamplingConfig
from cagrpo_ray.sync.coordinator import WeightSyncCoordinator

log = logging.getLogger("cagrpo_ray")


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling found too few groups with a signal within its bound."""


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


def step_seed(config: Config, step: int) -> int:
    """The sampling seed of learner step `step`'s prompts (each chunk derives its own)."""
    return config.run.seed * 1_000_003 + step


def idle_fraction(busy_seconds: float, replicas: int, wall_seconds: float) -> float:
    """Share of the replicas' wall time in which none of their requests was running."""
    if replicas == 0 or wall_seconds <= 0:
        return 0.0
    return float(min(1.0, max(0.0, 1.0 - busy_seconds / (replicas * wall_seconds))))


class Scheduler:
    """The training loop of one run: `step()` is one learner step; state is checkpointable.

    The roles are built by the caller (`Trainer`): the generator `pool`, the `reward_pool`
    actor, the `learners`, the weight-sync `coordinator`, the rollout `buffer`; `wait(refs,
    what)` is a `ray.get` that logs long waits.
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
        buffer: RolloutBuffer,
        wait,
        inspect_dir=None,
    ):
        self.config = config
        self.tokenizer, self.train_source = tokenizer, train_source
        self.pool, self.reward_pool, self.learners = pool, reward_pool, learners
        self.coordinator, self.buffer = coordinator, buffer
        self._wait = wait
        self.inspect_dir = inspect_dir  # the run directory when steps are inspected
        self.max_staleness = config.run.max_staleness
        self.instruction = prompt_preamble(config.data)
        self.step = 0
        self.policy_version = 0
        self.cursor = 0  # index of the next new training prompt
        self.requeue = Requeue()  # lost chunks, generated again before new prompts
        self.next_group_id = 0
        self.reward_refs: dict = {}  # ObjectRef -> (PromptChunk, completions per prompt)
        self.learn_refs: list = []
        self.tokens_generated = 0.0
        self.verifier_errors = 0
        self.unparsed = 0  # scored responses in which the task verifier found no answer
        self.scored_responses = 0
        self.component_sums: dict[str, float] = {}  # reward functions' own components, summed
        self.spanning_loads = 0  # responses generated across a weight load (in-flight mode)
        self.filtered_groups = 0  # dropped by dynamic sampling (all rewards equal)
        self.scored_since_batch = 0  # groups scored toward the next batch
        self.overlong_penalized = 0
        a = config.algorithm
        self.kappa_controller = (
            KappaController(a.cagrpo_kappa, a.kappa_entropy_band, a.kappa_rate, a.kappa_range)
            if a.kappa_control == "entropy"
            else None
        )

    # ------------------------------------------------------------------- state

    def state(self) -> dict:
        """What a checkpoint needs to continue; prompts started but not yet buffered go
        first after a resume."""
        pending = list(self.pool.in_flight_tags())
        pending += [chunk for chunk, _ in self.reward_refs.values()]
        return {
            "step": self.step,
            "cursor": self.cursor,
            "policy_version": self.policy_version,
            "requeue": self.requeue.state(pending),
            "next_group_id": self.next_group_id,
            "kappa_controller": self.kappa_controller and self.kappa_controller.state(),
        }

    def restore(self, state: dict) -> None:
        self.step, self.cursor = state["step"], state["cursor"]
        self.policy_version = state["policy_version"]
        next_id = state.get("next_group_id", self.step * self.config.rollout.prompts_per_step)
        self.requeue, self.next_group_id = Requeue.from_state(state.get("requeue", []), next_id)
        if self.kappa_controller is not None and state.get("kappa_controller"):
            self.kappa_controller = KappaController.from_state(state["kappa_controller"])

    def start(self) -> None:
        """Form the weight-sync group and serve the learner's weights from the first step."""
        self.coordinator.build_group()
        self.coordinator.sync(self.policy_version)

    # ------------------------------------------------------------------- the loop

    def train_step(self) -> dict:
        """One learner step: wait for a batch within the bound, train on it, start the sync."""
        cfg = self.config
        P = cfg.rollout.prompts_per_step
        t_start = time.perf_counter()
        busy_before, tokens_before = self.pool.busy_seconds, self.tokens_generated
        errors_before, dropped_before = self.verifier_errors, self.buffer.dropped_stale
        unparsed_before, responses_before = self.unparsed, self.scored_responses
        components_before = dict(self.component_sums)
        spanning_before = self.spanning_loads
        filtered_before, penalized_before = self.filtered_groups, self.overlong_penalized

        # (1) Wait for a batch within the staleness bound (generation goes on meanwhile).
        min_version = self.policy_version - self.max_staleness
        while True:
            self.buffer.drop_stale(min_version)
            if len(self.buffer) >= P:
                break
            self._check_dynamic_sampling()
            self._pump()
        # Groups arrive in completion order; the learner sees them in the order they were
        # started, so the batch does not depend on which replica finished first.
        table = self.buffer.take(P, min_version=min_version).sort_by("group_id")
        # groups already kept for the next batch count toward it
        scored, self.scored_since_batch = self.scored_since_batch, len(self.buffer)
        t_batch = time.perf_counter()

        # (2) Train on it; the learner runs its pending weight send first (actor order).
        batch = to_learner_batch(table, pad_token_id=self.tokenizer.pad_token_id)
        if cfg.algorithm.overlong == "mask":  # truncated responses carry no loss
            truncated = np.asarray(table.column("finish_reason").to_pylist()) == "length"
            batch["response_mask"][torch.from_numpy(truncated)] = False
        staleness = self.policy_version - batch["policy_version"]
        inspect = self._groups_to_inspect(batch)
        control = self.kappa_controller
        options = {"cagrpo_kappa": control.kappa} if control is not None else None
        self.learn_refs = self.learners.submit_train_step(batch, inspect, options)
        while self._pending(self.learn_refs):
            self._pump(wait_on=self.learn_refs)
        learner_metrics = self.learners.collect(self.learn_refs, "train_step")[0]
        self.learn_refs = []
        if control is not None:  # this step's kappa, then the next step's from its entropy
            learner_metrics["cagrpo/kappa"] = options["cagrpo_kappa"]
            control.update(learner_metrics["entropy/mean"])
        t_trained = time.perf_counter()
        self.step += 1
        self.policy_version = self.step
        if inspect:
            kept = self.learners.inspection()
            meta = {"step": self.step, "policy_loss": cfg.algorithm.policy_loss,
                    "cov_scope": cfg.algorithm.cov_scope, "run_name": cfg.run.name}  # fmt: skip
            capture_step(self.inspect_dir, self.step, table, batch, kept, self.tokenizer, meta)

        # (3) Broadcast the new weights; replicas load them between requests.
        self.coordinator.finish()  # the previous broadcast (normally long done)
        sync_metrics = dict(self.coordinator.last)
        if self.pool.needs_weights:
            self._resync()  # a replica restarted or a broadcast failed
        else:
            self.coordinator.start(self.policy_version)
        self._dispatch()
        step_time = time.perf_counter() - t_start

        metrics = rollout_metrics(table, cfg.rollout.group_size, cfg.rollout.max_turns > 1)
        metrics.update(
            {f"learner/{k}" if "/" not in k else k: v for k, v in learner_metrics.items()}
        )
        trained_tokens = float(batch["response_mask"].sum())
        generated = self.tokens_generated - tokens_before
        busy = self.pool.busy_seconds - busy_before
        metrics.update(
            {
                "reward/verifier_errors": self.verifier_errors - errors_before,
                # of the responses scored since the last step (what generation produced)
                "reward/unparsed_fraction": (self.unparsed - unparsed_before)
                / max(1, self.scored_responses - responses_before),
                "time/wait_batch": t_batch - t_start,
                "time/train": t_trained - t_batch,
                "time/sync": sync_metrics.get("sync/seconds", 0.0),
                "time/step": step_time,
                **sync_metrics,
                # per second of the whole step, whatever the bound, so runs compare
                "throughput/generated_tokens_per_s": generated / step_time,
                "throughput/trained_tokens_per_s": trained_tokens / max(t_trained - t_batch, 1e-9),
                "throughput/samples_per_s": len(batch["rewards"]) / step_time,
                "buffer/depth_groups": len(self.buffer),
                "buffer/dropped_stale_groups": self.buffer.dropped_stale,
                "buffer/dropped_this_step": self.buffer.dropped_stale - dropped_before,
                "dynamic_sampling/filtered_groups": self.filtered_groups - filtered_before,
                "dynamic_sampling/scored_groups": scored,
                "reward/overlong_penalized": self.overlong_penalized - penalized_before,
                "staleness/mean": float(staleness.float().mean()),
                "staleness/max": int(staleness.max()),
                "staleness/values": staleness.numpy(),
                "generators/restarts": self.pool.restarts,
                "generators/idle_fraction": idle_fraction(busy, self.pool.num_replicas, step_time),
                "policy_version": self.policy_version,
                "data/cursor": self.cursor,
                "tokens/generated": generated,
            }
        )
        scored = max(1, self.scored_responses - responses_before)
        for name, total in self.component_sums.items():  # e.g. reward/gsm8k/strict_format
            metrics[f"reward/{name}"] = (total - components_before.get(name, 0.0)) / scored
        if cfg.rollout.weight_update == "in_flight":
            metrics["rollout/spanning_load_fraction"] = (
                self.spanning_loads - spanning_before
            ) / max(1, self.scored_responses - responses_before)
        return metrics

    def _groups_to_inspect(self, batch) -> list[int] | None:
        """The groups whose tokens the coming learner step keeps for the inspector, if any."""
        m = self.config.metrics
        if self.inspect_dir is None or not m.inspect_every or (self.step + 1) % m.inspect_every:
            return None
        return groups_to_inspect(batch["group_ids"].numpy(), m.inspect_groups, self.step + 1)

    def _outstanding(self) -> int:
        """Groups not yet taken by the learner: buffered, being scored, being generated."""
        in_flight = sum(len(tag.indices) for tag in self.pool.in_flight_tags())
        scoring = sum(len(chunk.indices) for chunk, _ in self.reward_refs.values())
        return len(self.buffer) + in_flight + scoring

    def _dispatch(self) -> None:
        """Give every idle replica a chunk, as far as the staleness bound (1) admits."""
        cfg = self.config
        if self.pool.needs_weights and not self.learn_refs:
            self._resync()  # only while the learner is idle: its weights are policy_version
        train_version = self.policy_version + (1 if self.learn_refs else 0)
        while True:
            outstanding = self._outstanding()
            # nothing past the run's last step: that would be generated and never trained
            needed = (cfg.run.steps - train_version) * cfg.rollout.prompts_per_step - outstanding
            count = min(cfg.rollout.chunk_prompts, needed)
            replicas = self.pool.available_replicas(count) if count > 0 else []
            if not replicas:
                return
            replica = replicas[0]  # the least loaded
            room = admissible_groups(
                self.pool.version(replica),
                train_version,
                outstanding,
                cfg.rollout.prompts_per_step,
                self.max_staleness,
            )
            count = min(count, room)
            if count <= 0:
                return
            self._submit(replica, count)

    def _submit(self, replica: int, count: int) -> None:
        """Start the next `count` prompt groups on `replica`."""
        cfg = self.config
        if self.requeue:  # a lost chunk first, under its own group ids: its own seeds
            chunk = self.requeue.take(count)
            indices, group_ids = chunk.indices, chunk.group_ids
        else:
            indices = tuple(self._next_index() for _ in range(count))
            group_ids = tuple(range(self.next_group_id, self.next_group_id + count))
            self.next_group_id += count
        prompts = [
            format_prompt(self.tokenizer, self.train_source[i].question, self.instruction)
            for i in indices
        ]
        # Seeds fixed by each group's place (step, index in the step), not by timing.
        step, start = divmod(group_ids[0], cfg.rollout.prompts_per_step)
        base = self.sampling(cfg.rollout.group_size, cfg.rollout.temperature, step_seed(cfg, step))
        sampling = chunk_sampling(base, start)
        self.pool.submit(replica, prompts, sampling, PromptChunk(indices, group_ids))

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

    def _next_index(self) -> int:
        if self.cursor >= len(self.train_source):
            self.cursor = 0  # a new epoch over the same prompts, in the same order
        index = self.cursor
        self.cursor += 1
        return index

    def _pump(self, wait_on: list | None = None) -> None:
        """Dispatch work, then handle whatever finishes first (or `wait_on`'s refs)."""
        self._dispatch()
        refs = self._waitable(wait_on)
        if not refs and wait_on:
            return  # what the caller waits for finished since it last looked
        while not refs and self.pool.loading:
            # A replica's weight load finished after the dispatch above held the work for it
            # and before the refs were listed (so the sync is no longer pending): dispatch
            # again, now that the pool sees the load is over.
            self._dispatch()
            refs = self._waitable(wait_on)
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

    def _waitable(self, wait_on: list | None) -> list:
        """What `_pump` may wait for: generation, scoring, `wait_on` and the sync in flight."""
        refs = self.pool.in_flight() + list(self.reward_refs)
        return refs + self._pending(wait_on or []) + self.coordinator.pending()

    def _on_generated(self, ref) -> None:
        self._handle_finished(self.pool.finish(ref))

    def _handle_finished(self, finished) -> None:
        """A chunk came back: score it, or requeue its prompts if its replica was lost."""
        chunk: PromptChunk = finished.chunk.tag
        if finished.lost:
            self.requeue.push(chunk)
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
        chunk, groups = self.reward_refs.pop(ref)
        results = self._wait([ref], "verifiers")[0]
        g = self.config.rollout.group_size
        self.verifier_errors += sum(r.error is not None for r in results)
        self.unparsed += sum(not r.parsed for r in results)
        self.scored_responses += len(results)
        for result in results:
            for name, value in result.components.items():
                if "/" in name:  # a reward function's dict: its keys besides the score
                    self.component_sums[name] = self.component_sums.get(name, 0.0) + value
        lengths = [len(c.token_ids) for group in groups for c in group]
        scored = score_groups(
            results, lengths, g, self.config.algorithm, self.config.rollout.max_tokens
        )
        self.overlong_penalized += scored.penalized
        for k, (index, group_id, group) in enumerate(
            zip(chunk.indices, chunk.group_ids, groups, strict=True)
        ):
            self.scored_since_batch += 1
            if not scored.keep[k]:
                self.filtered_groups += 1  # all rewards equal: no signal (dynamic sampling)
                continue
            sl = slice(k * g, (k + 1) * g)
            self.buffer.add(
                group_record_batch(
                    self.train_source[index].uid,
                    group_id,
                    group,
                    scored.rewards[sl].tolist(),
                    scored.correct[sl],
                    scored.advantages[sl].tolist(),
                )
            )

    def _check_dynamic_sampling(self) -> None:
        """Stop, rather than generate forever, when too few groups carry a signal."""
        a, P = self.config.algorithm, self.config.rollout.prompts_per_step
        if a.dynamic_sampling and self.scored_since_batch >= a.max_gen_batches * P:
            raise DynamicSamplingError(
                f"dynamic sampling: {self.scored_since_batch} groups were scored for learner "
                f"step {self.step + 1} and only {len(self.buffer)} of the {P} needed had "
                f"rewards that differ (algorithm.max_gen_batches is {a.max_gen_batches}); the "
                "task gives (nearly) every group equal rewards: make it harder or easier, or "
                "turn algorithm.dynamic_sampling off"
            )

    def _resync(self) -> None:
        """Bring every replica to `policy_version` (learner idle): finish what is generating
        (results are kept), then rebuild the sync group and load the weights."""
        self.coordinator.finish()
        for finished in self.pool.drain():
            self._handle_finished(finished)
        self.coordinator.resync(self.policy_version)

    # ------------------------------------------------------------- run boundaries

    def finish_rollouts(self) -> None:
        """Generation and scoring in flight land in the buffer; the last sync completes."""
        while self.pool.in_flight() or self.reward_refs:
            refs = self.pool.in_flight() + list(self.reward_refs)
            done, _ = ray.wait(refs, num_returns=1)
            if self.pool.owns(done[0]):
                self._on_generated(done[0])
            else:
                self._on_scored(done[0])
        self.coordinator.finish()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig):
        """Blocking generation over every replica (for evaluation), after what is in flight
        has landed; a replica that needs weights is resynced first."""
        self.finish_rollouts()
        return self.pool.generate(prompts, sampling, resync=self._resync)

    @staticmethod
    def _pending(refs: list) -> list:
        """The refs of `refs` that are not finished yet."""
        if not refs:
            return []
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        return pending
