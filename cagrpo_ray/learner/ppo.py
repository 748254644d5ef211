"""The PPO epochs of a learner step: `ppo_epochs` passes over `mini_batches` mini-batches of
whole prompt groups, each one optimizer step over its micro-batches.

`Learner.train_step` (learner.py) runs the proximal pass, the off-policy correction and the
loss preparation, then hands `ppo_epochs` what every update shares (`UpdateInputs`). Each
update's loss is normalised by its mini-batch's tokens over all ranks, so an update does not
depend on how the mini-batch is cut into micro-batches and ranks. With the defaults (one pass,
one mini-batch) it is one optimizer step on the whole batch. `token_records` and
`policy_change` are what a step keeps for inspection after its updates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cagrpo_ray.algo import LossSpec, PreparedLoss, policy_loss, prepare_loss_inputs
from cagrpo_ray.learner.batch import group_sizes
from cagrpo_ray.learner.distributed import RankReducer, all_reduce_, data_parallel_group
from cagrpo_ray.learner.forward import ForwardPasses
from cagrpo_ray.learner.settings import LearnerSettings


@dataclass(frozen=True)
class UpdateInputs:
    """What every update of one learner step shares (this rank's rows)."""

    batch: dict[str, torch.Tensor]
    old_logprobs: torch.Tensor  # [B, T] the proximal policy's
    advantages: torch.Tensor  # [B]
    ref_logprobs: torch.Tensor | None  # [B, T]
    is_weights: torch.Tensor | None  # [B, T]
    clipped: torch.Tensor | None  # [B, T] bool, kept for the inspector: ratio clipped
    rollout_stats: PreparedLoss  # the loss's statistics of the whole rollout batch
    horizon: int  # Dr.GRPO's constant L
    stats_seed: int  # the seed of this step's statistics (Clip-Cov's draws)
    # the fused proximal pass's micro-batches and their (log-probs, entropies) with gradient
    fused: tuple[list[torch.Tensor], list] | None


def ppo_epochs(
    engine,
    passes: ForwardPasses,
    loss: LossSpec,
    settings: LearnerSettings,
    inputs: UpdateInputs,
    world_size: int,
) -> list[dict[str, float]]:
    """`settings.ppo_epochs` passes over `settings.mini_batches` mini-batches, one optimizer
    step of `engine` (the DeepSpeed engine around `passes.policy`) each; returns each update's
    metrics, reduced over ranks."""
    updates = []
    minis = mini_batches(inputs.batch["group_ids"], settings.mini_batches)
    for epoch in range(settings.ppo_epochs):
        for index, rows in enumerate(minis):
            first = epoch == 0 and index == 0
            recompute = settings.token_stats == "minibatch" and not first
            prepared = mini_batch_stats(passes, loss, inputs, rows, recompute)
            updates.append(update(engine, passes, loss, inputs, rows, prepared, world_size))
    return updates


def update(
    engine,
    passes: ForwardPasses,
    loss: LossSpec,
    inputs: UpdateInputs,
    rows: torch.Tensor,
    prepared: PreparedLoss,
    world_size: int,
) -> dict[str, float]:
    """One optimizer step on mini-batch `rows` (this rank's row indices), micro-batch by
    micro-batch; returns its metrics, reduced over ranks. With `inputs.fused` the micro-batches
    and their log-probs are the proximal pass's, already computed with gradient."""
    batch, mask, fused = inputs.batch, inputs.batch["response_mask"], inputs.fused
    reducer = RankReducer(passes.device)
    micro = fused[0] if fused is not None else passes.batch_micro_batches(batch, rows)
    for index, within in enumerate(micro):
        padding = within.numel() == 0
        if padding:  # another rank has more micro-batches; ZeRO needs as many passes here
            within = torch.zeros(1, dtype=torch.long)
        at = rows[within]  # row indices into the rank's batch
        engine.set_gradient_accumulation_boundary(index == len(micro) - 1)
        with_entropy = bool(loss.entropy_coef)
        if fused is not None:  # computed with gradient in the proximal pass
            logprobs, entropy = fused[1][index]
            entropy = entropy if with_entropy else None
        else:
            logprobs, entropy = passes.logprobs(engine, batch, at, with_entropy)
        out = policy_loss(
            loss,
            logprobs,
            inputs.old_logprobs[at],
            inputs.advantages[at],
            mask[at],
            ref_logprobs=None if inputs.ref_logprobs is None else inputs.ref_logprobs[at],
            entropy=entropy,
            is_weights=None if inputs.is_weights is None else inputs.is_weights[at],
            prepared=prepared.rows(within),
        )
        step_loss = out.loss * 0.0 if padding else out.loss
        if inputs.clipped is not None and out.clipped is not None and not padding:
            inputs.clipped[at] = out.clipped  # the loss's own clip rule, for the inspector
        if not padding:
            for name, value in out.metrics.items():
                if name not in prepared.metrics and name != "entropy/mean":
                    reduce_micro_batch_metric(reducer, name, value, mask[at].sum())
        # The loss is already divided by the mini-batch's global token count; DeepSpeed
        # averages the gradients over ranks, which the factor world_size undoes.
        engine.backward(step_loss * world_size)
    grad_norm = _grad_norm_before_step(engine)
    engine.step()
    metrics = reducer.reduce()
    metrics["grad_norm"] = grad_norm if grad_norm is not None else _grad_norm_after_step(engine)
    return metrics


def _grad_norm_before_step(engine) -> float | None:
    """Stage 0 only: the global norm of the averaged gradients before clipping (ZeRO
    optimizers report it themselves in `_grad_norm_after_step`)."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _grad_norm_after_step(engine) -> float:
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def reduce_micro_batch_metric(reducer: RankReducer, name: str, value: float, tokens) -> None:
    """policy_loss's per-call metrics: loss shares and counts add up over micro-batches
    and ranks, maxima take the max, the rest are token-weighted means."""
    if name in ("loss/total", "policy/loss", "policy/tokens"):
        reducer.sum(name, value)
    elif name.endswith("_max"):
        reducer.max(name, value)
    else:
        reducer.mean(name, value, tokens)


def reduce_batch_metric(reducer: RankReducer, name: str, value: float, tokens) -> None:
    """prepare_loss_inputs' statistics are per rank: min and max combine exactly, means
    (and quantiles, approximately) token-weighted."""
    if name.endswith("_min"):
        reducer.min(name, value)
    elif name.endswith("_max"):
        reducer.max(name, value)
    else:
        reducer.mean(name, value, tokens)


def mini_batches(group_ids: torch.Tensor, count: int) -> list[torch.Tensor]:
    """This rank's row indices of each mini-batch: `count` equal slices of whole groups, in
    order (mini-batch j is the j-th slice of every rank's shard)."""
    sizes = group_sizes(group_ids)
    if len(sizes) % count:
        raise ValueError(
            f"this learner rank holds {len(sizes)} prompt groups, which do not split into "
            f"{count} mini-batches of whole groups"
        )
    rows = torch.arange(group_ids.shape[0], device=group_ids.device)
    return list(rows.split(len(sizes) // count * int(sizes[0])))


def mini_batch_stats(
    passes: ForwardPasses,
    loss: LossSpec,
    inputs: UpdateInputs,
    rows: torch.Tensor,
    recompute: bool,
) -> PreparedLoss:
    """The loss's statistics for mini-batch `rows`: the rollout batch's (fixed from the old
    policy), or with `recompute` taken afresh on the current policy's log-probs
    (`token_stats="minibatch"`, after the first update); normalised by the mini-batch's tokens
    over all ranks."""
    batch = inputs.batch
    mask = batch["response_mask"][rows]
    if recompute:
        current = passes.no_grad(
            {k: v[rows] for k, v in batch.items()}, passes.batch_micro_batches(batch, rows)
        )[0]
        return prepare_loss_inputs(
            loss,
            current,
            inputs.advantages[rows],
            mask,
            batch["group_ids"][rows],
            seed=inputs.stats_seed,
            max_response_length=inputs.horizon,
            diagnostics=False,
            process_group=data_parallel_group(),
        )
    if rows.numel() == batch["response_mask"].shape[0]:
        return inputs.rollout_stats  # the whole batch: its own normalisers
    return inputs.rollout_stats.rows(rows).with_normalisers(
        num_tokens=float(all_reduce_(mask.sum().double().reshape(1))),
        num_seqs=float(all_reduce_((mask.sum(1) > 0).sum().double().reshape(1))),
    )


def policy_change(passes: ForwardPasses, batch, old_logprobs) -> dict[str, float]:
    """KL(pi_before || pi_after) of this step on its own samples: k1 and k3 estimates from
    one more no-grad pass (`measure_policy_change`)."""
    mask = batch["response_mask"]
    new = passes.no_grad(batch, passes.batch_micro_batches(batch))[0]
    d = (new - old_logprobs)[mask].double()  # log pi_after - log pi_before
    reducer = RankReducer(passes.device)
    n = mask.sum()
    reducer.mean("policy/kl_step", (d.exp() - d - 1).mean() if n else 0.0, n)
    reducer.mean("policy/kl_step_k1", (-d).mean() if n else 0.0, n)
    return reducer.reduce()


# The updates' detail worth keeping beside their means: where the last update ended up.
_LAST_UPDATE_KEYS = (
    "policy/ratio_max",
    "policy/ratio_mean",
    "policy/clip_frac",
    "policy/dual_clip_frac",
    "policy/approx_kl",
    "grad_norm",
)


def combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
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


def token_records(inputs: UpdateInputs, groups, entropy, stats, shown: dict) -> dict:
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
