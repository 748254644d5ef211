"""A learner step: PPO updates on one rollout batch, as methods of `Learner`.

`PPOSteps` is a mixin of `Learner` (learner.py): it uses the learner's engine, settings, loss
spec, scoring (`_score`, `_scores`, `_micro_batches`) and metric reducers, and adds
`train_step`. One step, on this rank's shard:

    1. score the batch under the current weights: the proximal (old) log-probs, entropies,
       and the reference policy's log-probs; the truncated IS weights against the generator's;
    2. the loss's batch statistics (kernel weights, Clip-Cov/KL-Cov selections), once over the
       rollout batch on all ranks;
    3. `ppo_epochs` passes over `mini_batches` mini-batches of whole groups, each one optimizer
       step over its micro-batches; the loss is normalised by the mini-batch's tokens over all
       ranks, so each update is independent of how the mini-batch is cut into micro-batches
       and ranks.

With the defaults (one pass, one mini-batch) it is one optimizer step on the whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cagrpo_ray.algo import policy_loss, prepare_loss_inputs, token_fields, truncated_is_weights
from cagrpo_ray.algo.registry import as_spec
from cagrpo_ray.learner.batch import check_batch, group_sizes
from cagrpo_ray.learner.distributed import RankReducer, all_reduce_, data_parallel_group


class PPOSteps:
    """`Learner.train_step` and the updates it runs (see the module docstring)."""

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        inspect_groups: list[int] | None = None,
        loss_options: dict | None = None,
    ) -> dict[str, float]:
        """One learner step on this rank's shard of a rollout batch: `ppo_epochs` passes over
        its mini-batches, one optimizer step per mini-batch (by default one pass over the
        whole batch: one optimizer step).

        batch: the learner batch of docs/architecture.md (keys `BATCH_KEYS`, whole prompt
        groups of one size). Every rank must call it, each with its own shard, and every rank
        holds as many groups (so that mini-batch j is the j-th slice of every shard). Returns
        metrics that are equal on every rank (reduced over micro-batches and ranks): the
        rollout batch's statistics, the updates' means, and the last update's detail.

        The loss's batch statistics (CA-GRPO's kernel weights, the Clip-Cov/KL-Cov
        selections) are fixed once per rollout batch from the proximal (old) policy's
        log-probs (`token_stats="rollout"`), or recomputed for each mini-batch from the
        current policy (`"minibatch"`, as verl does with its current log-probs); the loss
        normalisers are always the mini-batch's, over all ranks.

        `inspect_groups`: prompt groups whose per-token values this step keeps for the token
        inspector (`take_inspection`); the rank keeps those it holds. `loss_options`: loss
        options (`LossSpec` fields) set from this step on, e.g. a controller's `cagrpo_kappa`.
        """
        start = time.perf_counter()
        if loss_options:
            self.loss = as_spec(self.loss, loss_options)
        batch = self._to_device(check_batch(batch))
        mask = batch["response_mask"]
        reducer = RankReducer(self.device)
        tokens = mask.sum()
        reducer.sum("learner/tokens", tokens)
        reducer.sum("learner/responses", mask.shape[0])

        # (1) Proximal log-probs under the current weights: the ratio's denominator, and what
        # the loss's batch statistics (kernel weights, Clip-Cov/KL-Cov selections) are taken on.
        lengths = batch["attention_mask"].sum(1)
        micro = self._micro_batches(lengths, groups=self._groups(batch))
        fused = None
        if len(micro) == 1 and self.settings.ppo_epochs * self.settings.mini_batches == 1:
            # One update, and the batch fits one micro-batch: the training forward pass is the
            # proximal one (detached), as TRL does when it trains on-policy, so no second
            # forward is needed. It runs in length-sorted parts (all kept for the backward
            # pass), so that short rows are not padded to the longest.
            micro = self._micro_batches(
                lengths, count=self.settings.length_buckets, groups=self._groups(batch)
            )
            fused = [self._scores(self.engine, batch, rows, True) for rows in micro]
            old_logprobs = torch.zeros_like(batch["behavior_logprobs"])
            entropy = torch.zeros_like(old_logprobs)
            for rows, (logprobs, token_entropy) in zip(micro, fused, strict=True):
                old_logprobs[rows], entropy[rows] = logprobs.detach(), token_entropy.detach()
            fused = (micro, fused)
            ref_logprobs = self._score(batch, micro, full=False, ref_only=True)[2]
        else:
            old_logprobs, entropy, ref_logprobs = self._score(batch, micro)
        mismatch = (old_logprobs - batch["behavior_logprobs"]).abs()[mask]
        reducer.mean("logprob/mismatch_mean", mismatch.mean() if tokens else 0.0, tokens)
        reducer.max("logprob/mismatch_max", mismatch.max() if tokens else 0.0)
        reducer.mean("entropy/mean", entropy[mask].mean() if tokens else 0.0, tokens)
        is_weights = None
        if self.loss.tis_cap is not None:  # the off-policy correction (algo/off_policy.py)
            is_weights, tis_metrics = truncated_is_weights(
                old_logprobs, batch["behavior_logprobs"], mask, self.loss.tis_cap
            )
            for name, value in tis_metrics.items():
                reducer.mean(name, value, tokens)

        # (2) Group-relative advantages, computed when the groups were scored (one source).
        advantages = batch["advantages"]
        reducer.mean("reward/mean", batch["rewards"].mean(), mask.shape[0])
        reducer.mean("advantage/abs_mean", advantages.abs().mean(), mask.shape[0])

        # (3) Batch statistics, once over the whole rollout batch on all ranks.
        horizon = self._max_response_length(mask)
        rollout_stats = prepare_loss_inputs(
            self.loss,
            old_logprobs,
            advantages,
            mask,
            batch["group_ids"],
            seed=self.settings.seed * 1_000_003 + self.step,
            max_response_length=horizon,
            process_group=data_parallel_group(),
        )
        for name, value in rollout_stats.metrics.items():
            self._reduce_batch_metric(reducer, name, value, tokens)

        # (4) Updates: epochs x mini-batches, each one optimizer step over its micro-batches.
        lr = float(self.engine.optimizer.param_groups[0]["lr"])
        clipped = torch.zeros_like(mask) if inspect_groups else None
        inputs = _UpdateInputs(batch, old_logprobs, advantages, ref_logprobs, is_weights, clipped)
        updates = []
        minis = self._mini_batches(batch["group_ids"])
        for epoch in range(self.settings.ppo_epochs):
            for index, rows in enumerate(minis):
                first = epoch == 0 and index == 0
                prepared = self._mini_batch_stats(inputs, rows, rollout_stats, horizon, first)
                updates.append(self._update(inputs, rows, prepared, fused))
        self.step += 1

        metrics = reducer.reduce()
        metrics.update(_combine_updates(updates))
        if inspect_groups:
            shown = token_fields(self.loss, rollout_stats, mask)
            self.inspection = _token_records(inputs, inspect_groups, entropy, rollout_stats, shown)
        if self.settings.measure_policy_change:
            metrics.update(self._policy_change(batch, old_logprobs))
        metrics.update(
            {
                "lr": lr,
                "learner/step": float(self.step),
                "learner/updates": float(len(updates)),
                "time/train_step_s": time.perf_counter() - start,
            }
        )
        return metrics

    def _update(
        self, inputs: _UpdateInputs, rows: torch.Tensor, prepared, fused=None
    ) -> dict[str, float]:
        """One optimizer step on mini-batch `rows` (this rank's row indices), micro-batch by
        micro-batch; returns its metrics, reduced over ranks. `fused`: (micro-batches, their
        (log-probs, entropies)), already computed with gradient by `train_step`."""
        batch, mask = inputs.batch, inputs.batch["response_mask"]
        reducer = RankReducer(self.device)
        lengths = batch["attention_mask"][rows].sum(1)
        micro = (
            fused[0]
            if fused is not None
            else self._micro_batches(lengths, groups=self._groups(batch, rows))
        )
        for index, within in enumerate(micro):
            padding = within.numel() == 0
            if padding:  # another rank has more micro-batches; ZeRO needs as many passes here
                within = torch.zeros(1, dtype=torch.long)
            at = rows[within]  # row indices into the rank's batch
            self.engine.set_gradient_accumulation_boundary(index == len(micro) - 1)
            with_entropy = bool(self.loss.entropy_coef)
            if fused is not None:  # computed with gradient in train_step
                logprobs, entropy = fused[1][index]
                entropy = entropy if with_entropy else None
            else:
                logprobs, entropy = self._scores(self.engine, batch, at, with_entropy)
            out = policy_loss(
                self.loss,
                logprobs,
                inputs.old_logprobs[at],
                inputs.advantages[at],
                mask[at],
                ref_logprobs=None if inputs.ref_logprobs is None else inputs.ref_logprobs[at],
                entropy=entropy,
                is_weights=None if inputs.is_weights is None else inputs.is_weights[at],
                prepared=prepared.rows(within),
            )
            loss = out.loss * 0.0 if padding else out.loss
            if inputs.clipped is not None and out.clipped is not None and not padding:
                inputs.clipped[at] = out.clipped  # the loss's own clip rule, for the inspector
            if not padding:
                for name, value in out.metrics.items():
                    if name not in prepared.metrics and name != "entropy/mean":
                        self._reduce_micro_batch_metric(reducer, name, value, mask[at].sum())
            # The loss is already divided by the mini-batch's global token count; DeepSpeed
            # averages the gradients over ranks, which the factor world_size undoes.
            self.engine.backward(loss * self.world_size)
        grad_norm = self._grad_norm_before_step()
        self.engine.step()
        metrics = reducer.reduce()
        metrics["grad_norm"] = grad_norm if grad_norm is not None else self._grad_norm_after_step()
        return metrics

    @staticmethod
    def _reduce_micro_batch_metric(reducer: RankReducer, name: str, value: float, tokens) -> None:
        """policy_loss's per-call metrics: loss shares and counts add up over micro-batches
        and ranks, maxima take the max, the rest are token-weighted means."""
        if name in ("loss/total", "policy/loss", "policy/tokens"):
            reducer.sum(name, value)
        elif name.endswith("_max"):
            reducer.max(name, value)
        else:
            reducer.mean(name, value, tokens)

    @staticmethod
    def _reduce_batch_metric(reducer: RankReducer, name: str, value: float, tokens) -> None:
        """prepare_loss_inputs' statistics are per rank: min and max combine exactly, means
        (and quantiles, approximately) token-weighted."""
        if name.endswith("_min"):
            reducer.min(name, value)
        elif name.endswith("_max"):
            reducer.max(name, value)
        else:
            reducer.mean(name, value, tokens)

    def take_inspection(self) -> dict[str, np.ndarray]:
        """The per-token values the last step kept for the token inspector (and forget them):
        this rank's rows of the inspected groups, [r, T] arrays aligned with the batch."""
        records, self.inspection = getattr(self, "inspection", {}), {}
        return records

    def _mini_batches(self, group_ids: torch.Tensor) -> list[torch.Tensor]:
        """This rank's row indices of each mini-batch: `settings.mini_batches` equal slices of
        whole groups, in order (mini-batch j is the j-th slice of every rank's shard)."""
        count = self.settings.mini_batches
        sizes = group_sizes(group_ids)
        if len(sizes) % count:
            raise ValueError(
                f"this learner rank holds {len(sizes)} prompt groups, which do not split into "
                f"{count} mini-batches of whole groups"
            )
        rows = torch.arange(group_ids.shape[0], device=group_ids.device)
        return list(rows.split(len(sizes) // count * int(sizes[0])))

    def _mini_batch_stats(self, inputs, rows, rollout_stats, horizon: int, first: bool):
        """The loss's statistics for mini-batch `rows`: the rollout batch's (fixed from the
        old policy), or recomputed from the current policy (`token_stats="minibatch"`, after
        the first update); normalised by the mini-batch's tokens over all ranks."""
        batch = inputs.batch
        mask = batch["response_mask"][rows]
        if self.settings.token_stats == "minibatch" and not first:
            current = self._score(
                {k: v[rows] for k, v in batch.items()},
                self._micro_batches(
                    batch["attention_mask"][rows].sum(1), groups=self._groups(batch, rows)
                ),
                False,
            )[0]
            return prepare_loss_inputs(
                self.loss,
                current,
                inputs.advantages[rows],
                mask,
                batch["group_ids"][rows],
                seed=self.settings.seed * 1_000_003 + self.step,
                max_response_length=horizon,
                diagnostics=False,
                process_group=data_parallel_group(),
            )
        if rows.numel() == batch["response_mask"].shape[0]:
            return rollout_stats  # the whole batch: its own normalisers
        return rollout_stats.rows(rows).with_normalisers(
            num_tokens=float(all_reduce_(mask.sum().double().reshape(1))),
            num_seqs=float(all_reduce_((mask.sum(1) > 0).sum().double().reshape(1))),
        )

    def _policy_change(self, batch, old_logprobs) -> dict[str, float]:
        """KL(pi_before || pi_after) of this step on its own samples: k1 and k3 estimates from
        one more scoring pass (`measure_policy_change`)."""
        mask = batch["response_mask"]
        micro = self._micro_batches(batch["attention_mask"].sum(1), groups=self._groups(batch))
        new = self._score(batch, micro, False)[0]
        d = (new - old_logprobs)[mask].double()  # log pi_after - log pi_before
        reducer = RankReducer(self.device)
        n = mask.sum()
        reducer.mean("policy/kl_step", (d.exp() - d - 1).mean() if n else 0.0, n)
        reducer.mean("policy/kl_step_k1", (-d).mean() if n else 0.0, n)
        return reducer.reduce()


@dataclass(frozen=True)
class _UpdateInputs:
    """What every update of one learner step shares (this rank's rows)."""

    batch: dict[str, torch.Tensor]
    old_logprobs: torch.Tensor  # [B, T] the proximal policy's
    advantages: torch.Tensor  # [B]
    ref_logprobs: torch.Tensor | None  # [B, T]
    is_weights: torch.Tensor | None  # [B, T]
    clipped: torch.Tensor | None  # [B, T] bool, kept for the inspector: ratio clipped


# The updates' detail worth keeping beside their means: where the last update ended up.
_LAST_UPDATE_KEYS = (
    "policy/ratio_max",
    "policy/ratio_mean",
    "policy/clip_frac",
    "policy/dual_clip_frac",
    "policy/approx_kl",
    "grad_norm",
)


def _combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its updates': maxima of *_max, means of the rest, and the last
    update's ratio, clip fractions, KL to the old policy and gradient norm (`*_last`). One
    update gives its own metrics unchanged."""
    if len(updates) == 1:
        return dict(updates[0])
    out = {}
    for key in updates[0]:
        values = [u[key] for u in updates]
        out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    for key in _LAST_UPDATE_KEYS:
        if key in updates[-1]:
            out[f"{key}_last"] = updates[-1][key]
    return out


def _token_records(inputs: _UpdateInputs, groups, entropy, stats, shown: dict) -> dict:
    """The inspected groups' rows of this rank: per-token learner log-probs, entropy,
    covariance, what the loss shows (`algo.token_fields`: kernel weight, Clip-Cov / KL-Cov
    selections; None where it has none), IS weight and whether the ratio was clipped, as
    numpy arrays."""
    batch = inputs.batch
    rows = torch.isin(batch["group_ids"], torch.as_tensor(groups, device=batch["group_ids"].device))
    if not bool(rows.any()):
        return {}

    def pick(values):
        return None if values is None else values[rows].detach().float().cpu().numpy()

    def flag(values):
        return None if values is None else values[rows].cpu().numpy()

    return {
        "group_ids": batch["group_ids"][rows].cpu().numpy(),
        "logprob": pick(inputs.old_logprobs),
        "entropy": pick(entropy),
        "cov": pick(stats.covariance),
        "weight": pick(shown["weight"]),
        "clip_cov": flag(shown["clip_cov"]),
        "kl_cov": flag(shown["kl_cov"]),
        "is_weight": pick(inputs.is_weights),
        "clipped": inputs.clipped[rows].cpu().numpy(),
    }
