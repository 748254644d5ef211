"""Policy losses behind one registry: GRPO (PPO-clip, DAPO clip-higher), CA-GRPO, Clip-Cov, KL-Cov.

CA-GRPO (Wang, Liu, Zhou, Chen, "Taming Extreme Tokens: Covariance-Aware GRPO with
Gaussian-Kernel Advantage Reweighting", ACL 2026, arXiv 2605.11538), in one place:

    A step of policy gradient changes entropy by about -eta * Cov(log pi(o), A(o)) (Cui et al.
    2025), and that covariance is dominated by a few extreme tokens. Over a token set S (the
    valid tokens of a prompt group, or of the batch):

        c_t   = (log pi(o_t) - mean_S log pi) * (A_i - mean_S A)     A_i: advantage of t's response
        sigma = std_S(c)                                             population std (ddof = 0)
        w_t   = exp(-c_t^2 / (2 sigma^2))                            Gaussian kernel on c
        w~_t  = w_t * |S| / sum_S w                                  mean_S w~ = 1: budget kept

    and the PPO-clip surrogate is trained with A_i replaced by the constant w~_t * A_i:

        r_t   = pi(o_t) / pi_old(o_t)
        L_t   = max(-w~_t A_i r_t,  -w~_t A_i clip(r_t, 1 - eps_low, 1 + eps_high))

    Extreme tokens, in either tail of c, get small weights; no new hyperparameter. If sigma
    < 1e-8 every weight is 1. Here c uses pi_old's log-probs, so that the weights are fixed
    for the whole batch (they equal pi's on the first, on-policy pass).

Options beyond the paper (`LossSpec`): the kernel's width, w_t = exp(-c_t^2 / (2 kappa^2
sigma^2)) with `cagrpo_kappa` (1: the paper's; kappa -> infinity: every weight 1, GRPO), which
`KappaController` (`controllers.py`) can set step by step to hold the token entropy in a band;
and the ablations `cagrpo_kernel` = "unnormalized" (w instead of w~), "ones" (GRPO bit for
bit), "positive" / "negative" (the kernel on the tokens with c > 0, resp. c < 0, only; the
others keep w = 1 before the normalization).

Several updates per rollout batch
---------------------------------
The learner (`learner/ppo.py`) may take `ppo_epochs` passes over `mini_batch_size`-response
mini-batches, one optimizer step each. The statistics of `prepare_loss_inputs` (kernel weights,
Clip-Cov / KL-Cov selections) are then fixed once per rollout batch from pi_old's log-probs
(`token_stats="rollout"`, the default), or recomputed for every mini-batch from the current
policy's (`"minibatch"`, as verl does); the normalisers are each mini-batch's. From the second
update on r_t moves away from 1, so PPO's clipping, the dual-clip and KL-Cov's |log r| act.

The same equations as plain float64 loops, which the tests compare with: `tests/loss_reference.py`.

Baselines in the same registry: `grpo` (PPO-clip with separate eps_low / eps_high, i.e. DAPO's
clip-higher), and from Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models"): `clip_cov` (the surrogate of a random `clip_cov_ratio` of the
tokens whose covariance lies in (`clip_cov_lb`, `clip_cov_ub`) is zeroed, so they give no
gradient) and `kl_cov` (the top `kl_cov_ratio` of tokens by covariance get
`kl_cov_coef` * |log r_t|; no ratio clipping, so no dual-clip either, as in verl). Their
covariance is taken over the batch, with pi_old's log-probs like CA-GRPO's (verl uses pi's,
equal on the first, on-policy pass).

Dual-clip
---------
Every PPO-clip loss (grpo, cagrpo, clip_cov) also bounds the loss of a token with negative
advantage (Ye et al. 2020; verl's clip_ratio_c, default 3):

    L_t = min(max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  -A_t c)     A_t < 0

Without it, -A_t r_t grows without bound in r_t, and one token that pi now finds far likelier
than pi_old did can dominate a later pass over the batch. It never binds at r_t = 1, so the
first, on-policy pass is bit for bit the same with it or without (`clip_ratio_c=None`).

The whole loss, and its options
-------------------------------
    loss = agg(L_t) + kl_coef * agg(KL_t(pi || pi_ref)) - entropy_coef * agg(H_t)

with agg one of the `loss_agg` modes (`aggregation.py`: token-mean, seq-mean-token-mean,
seq-mean-token-sum, seq-mean-token-sum-norm) and KL_t one of the `kl_estimator`s
(`kl_penalty.py`: k1, abs, k2, k3). Each micro-batch may also carry truncated importance
weights from the behavior policy (`tis_cap`, `off_policy.py`).

A loss gets every option as one typed object, `LossSpec` (`registry.py`), built from the
config's `algorithm` section (`learner/settings.py`); adding an option is a field there (with its
one default), a config field that takes that default, and its use in the loss. The registry's
names are the config's allowed `algorithm.policy_loss` values.

Computed once per batch, then micro-batched
-------------------------------------------
Statistics over a whole scope and the loss normalisers are computed ONCE over the full batch,
on every data-parallel rank together, before micro-batching (`batch_stats.py`); each
micro-batch's loss is then its share of the full-batch loss:

    spec = LossSpec("cagrpo", clip_eps_high=0.28)
    prepared = prepare_loss_inputs(spec, old_logprobs, advantages, mask, group_ids,
                                   process_group=dp_group)         # this rank's whole batch
    for rows in micro_batches:                                     # slices or index tensors
        out = policy_loss(spec, new_logprobs(rows), old_logprobs[rows], advantages[rows],
                          mask[rows], prepared=prepared.rows(rows))
        out.loss.backward()                                        # accumulate, don't average

Summed over micro-batches and ranks, the gradients equal those of one call on the whole batch
(verl computes these statistics per micro-batch, so its update changes with the micro-batch
size). Data-parallel engines that *average* gradients over ranks need loss * world_size.

Adding a loss is one function and one name:

    @register_policy_loss("pg")                         # statistics=... for batch statistics
    def pg(x: LossInputs) -> tuple[Tensor, dict[str, float]]:
        return -x.advantages * x.ratio, {}              # [B, T] per-token loss, metrics
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cagrpo_ray.algo.aggregation import LOSS_AGG_MODES, aggregate
from cagrpo_ray.algo.batch_stats import (
    BatchInputs,
    PreparedLoss,
    TokenStats,
    cagrpo_statistics,
    clip_cov_statistics,
    covariance_diagnostics,
    diagnostic_covariance,
    kl_cov_statistics,
)
from cagrpo_ray.algo.covariance import cagrpo_token_weights, token_covariance
from cagrpo_ray.algo.kl_penalty import KL_ESTIMATORS, kl_estimate
from cagrpo_ray.algo.off_policy import weight_gradient
from cagrpo_ray.algo.registry import (
    CAGRPO_KERNELS,
    INSPECTOR_FIELDS,
    POLICY_LOSSES,
    LossInputs,
    LossSpec,
    TokenLoss,
    as_spec,
    lookup_loss,
    register_policy_loss,
)
from cagrpo_ray.algo.stats import RowLayout, float_mask, global_count

__all__ = [
    "CAGRPO_KERNELS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "BatchInputs",
    "INSPECTOR_FIELDS",
    "LossInputs",
    "LossSpec",
    "PolicyLossOutput",
    "PreparedLoss",
    "TokenLoss",
    "TokenStats",
    "aggregate",
    "cagrpo_token_weights",
    "kl_estimate",
    "policy_loss",
    "ppo_clip",
    "prepare_loss_inputs",
    "register_policy_loss",
    "token_covariance",
    "token_fields",
]

LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here (as verl does), so exp never overflows


def ppo_clip(x: LossInputs, advantages: Tensor) -> TokenLoss:
    """PPO-clip with asymmetric range (DAPO clip-higher) and dual-clip, per token:

        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))
        L_t = min(L_t, -A_t c)                        only where A_t < 0, if clip_ratio_c = c

    The dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL";
    verl's clip_ratio_c) bounds a negative-advantage token's loss at |A_t| c: the clip alone
    leaves -A_t r_t unbounded as r_t grows, so one token that the policy now finds far likelier
    than pi_old did could dominate the update. Where it binds the loss is a constant: no
    gradient. At r_t = 1 (the first, on-policy pass) it never binds, and the loss and its
    gradient are bit for bit those without it.

    `advantages` is [B, 1] or [B, T]. Metrics, as fractions of the valid tokens: the clip
    active (no gradient), split into r_t > 1 + eps_high (A > 0) and r_t < 1 - eps_low (A < 0);
    and the dual clip binding. The tokens where the clip is active are returned too (the
    token inspector's "clipped").
    """
    unclipped = -advantages * x.ratio
    eps_low, eps_high = x.spec.clip_eps_low, x.spec.clip_eps_high
    clipped = -advantages * x.ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.maximum(unclipped, clipped)
    dual_bound = None
    if x.spec.clip_ratio_c is not None:
        dual = -advantages * x.spec.clip_ratio_c
        # torch.where, not torch.minimum: only A < 0 is bounded, and wherever the bound does
        # not bind the surrogate and its gradient pass through untouched (even at a tie)
        dual_bound = torch.lt(advantages, 0.0).logical_and(torch.gt(surrogate, dual))
        token_loss = torch.where(dual_bound, dual, surrogate)
    else:
        token_loss = surrogate
    with torch.no_grad():  # off the mask r_t = 1, so neither clip is ever active there
        active = torch.gt(clipped, unclipped)
        count = float(active.sum())
        high = float(active.logical_and(x.ratio > 1.0).sum())
        n = max(x.num_valid, 1.0)
        metrics = {
            "policy/clip_frac": count / n,
            "policy/clip_frac_high": high / n,
            "policy/clip_frac_low": (count - high) / n,
            "policy/dual_clip_frac": 0.0 if dual_bound is None else float(dual_bound.sum()) / n,
        }
    return TokenLoss(token_loss, metrics, active)


# What each loss shows in the token inspector, beside what every loss has (covariance, entropy,
# log-probs, the clip): CA-GRPO its kernel weights, Clip-Cov and KL-Cov the tokens they chose.
def kernel_weight_field(prepared: PreparedLoss, mask: Tensor) -> dict[str, Tensor]:
    return {"weight": prepared.token_weights}


def clip_cov_field(prepared: PreparedLoss, mask: Tensor) -> dict[str, Tensor]:
    return {"clip_cov": prepared.token_weights.eq(0) & mask.bool()}


def kl_cov_field(prepared: PreparedLoss, mask: Tensor) -> dict[str, Tensor]:
    return {"kl_cov": prepared.kl_penalty.gt(0)}


@register_policy_loss("grpo")
def grpo(x: LossInputs) -> TokenLoss:
    """GRPO / DAPO: PPO-clip on the response advantage A_i."""
    return ppo_clip(x, x.advantages)


@register_policy_loss(
    "cagrpo", statistics=cagrpo_statistics, token_fields=kernel_weight_field, shows="weight"
)
def cagrpo(x: LossInputs) -> TokenLoss:
    """CA-GRPO: PPO-clip with A_i replaced by the constant w~_t * A_i."""
    return ppo_clip(x, x.advantages * x.prepared.token_weights)


@register_policy_loss("clip_cov", statistics=clip_cov_statistics, token_fields=clip_cov_field)
def clip_cov(x: LossInputs) -> TokenLoss:
    """Clip-Cov: PPO-clip, with the selected tokens' surrogate set to 0 (weight 0)."""
    return ppo_clip(x, x.advantages * x.prepared.token_weights)


@register_policy_loss("kl_cov", statistics=kl_cov_statistics, token_fields=kl_cov_field)
def kl_cov(x: LossInputs) -> TokenLoss:
    """KL-Cov: L_t = -A_i r_t + kl_cov_coef * |log r_t| on the selected tokens (no clipping)."""
    penalty = x.prepared.kl_penalty * x.log_ratio.abs()
    with torch.no_grad():
        n = max(float(x.prepared.kl_penalty.mul(x.mask).sum()), 1.0)
        metrics = {"kl_cov/abs_log_ratio": float(penalty.sum()) / n}
    return TokenLoss(-x.advantages * x.ratio + x.spec.kl_cov_coef * penalty, metrics)


# ----------------------------------------------------------------------------------------------
# The public entry points
# ----------------------------------------------------------------------------------------------


def prepare_loss_inputs(
    spec: LossSpec | str,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    seed: int | None = None,
    max_response_length: int | None = None,
    diagnostics: bool = True,
    process_group=None,
    **options,
) -> PreparedLoss:
    """Everything loss `spec` needs from the whole batch, computed once before micro-batching.

    Args:
        spec: the `LossSpec` (or a loss name, with LossSpec fields as `options`).
        old_logprobs: [B, T] log pi_old of the sampled tokens (behavior or recomputed).
        advantages: [B], one per response.  mask: [B, T] bool or 0/1.
        group_ids: [B] prompt group of each response (needed for cov_scope="group").
            Clip-Cov and KL-Cov always select over the batch, as their reference
            implementation does.
        seed: Clip-Cov's random draw; None draws it from torch's default generator (one
            rank's draw is used by all). Same seed, same tokens, however the batch is split.
        max_response_length: Dr.GRPO's L; None uses the widest T over ranks.
        diagnostics: also compute statistics for the metrics: mean, std and quantile table of
            c (centred over cov_scope, or over the batch without group_ids) and kernel-weight
            quantiles, over this rank's tokens. They sort the tokens, so they cost more than
            the loss itself.
        process_group: data-parallel group; statistics and normalisers then span all its ranks.

    Returns:
        PreparedLoss; pass `prepared.rows(index)` to `policy_loss` with each micro-batch.
    """
    spec = as_spec(spec, options)
    registered = lookup_loss(spec.name)
    B, T = old_logprobs.shape
    if advantages.shape != (B,) or mask.shape != (B, T):
        raise ValueError(
            f"expected advantages [{B}] and mask [{B}, {T}] to match old_logprobs; "
            f"got {tuple(advantages.shape)} and {tuple(mask.shape)}"
        )
    device = old_logprobs.device
    with torch.no_grad():
        m = float_mask(mask)
        tokens_per_row = m.sum(1)
        num_tokens = global_count(float(tokens_per_row.sum()), device, process_group)
        num_seqs = global_count(float((tokens_per_row > 0).sum()), device, process_group)
        layout = RowLayout.of(B, T, device, process_group)
        batch = BatchInputs(
            spec, old_logprobs.detach(), advantages.detach(), m, group_ids, seed, num_tokens,
            layout, process_group, diagnostics,
        )  # fmt: skip
        stats = registered.statistics(batch)
        metrics = dict(stats.metrics)
        covariance = None
        if diagnostics:
            metrics.update(covariance_diagnostics(batch))
            covariance = diagnostic_covariance(batch)
    horizon = max_response_length or layout.width
    return PreparedLoss(
        spec.name, num_tokens, num_seqs, horizon, stats.token_weights, stats.kl_penalty, metrics,
        covariance,
    )  # fmt: skip


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: Tensor  # scalar, with gradient
    metrics: dict[str, float]
    clipped: Tensor | None = None  # [B, T] bool: the loss's clip held the ratio (None: no clip)


def policy_loss(
    spec: LossSpec | str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    is_weights: Tensor | None = None,
    prepared: PreparedLoss | None = None,
    seed: int | None = None,
    process_group=None,
    **options,
) -> PolicyLossOutput:
    """Policy loss `spec` ("grpo", "cagrpo", "clip_cov", "kl_cov", ...) for one (micro-)batch.

        loss = agg(L_t) + kl_coef * agg(KL_t(pi || pi_ref)) - entropy_coef * agg(H_t)

    with KL_t the `spec.kl_estimator` estimate (`kl_penalty.py`) and agg `spec.loss_agg`.

    Args:
        spec: the `LossSpec` (or a loss name, with LossSpec fields as `options`).
        logprobs: [B, T] log pi(o_t) under the policy being trained, with gradient.
        old_logprobs: [B, T] log pi_old(o_t).  advantages: [B].  mask: [B, T] bool or 0/1.
        group_ids: [B] prompt groups, for cov_scope="group" when `prepared` is None.
        ref_logprobs: optional [B, T] reference-policy log-probs (the KL term, `spec.kl_coef`;
            its mean over valid tokens is logged as "kl/ref_<estimator>", e.g. "kl/ref_k3").
        entropy: optional [B, T] token entropies with gradient (bonus `spec.entropy_coef`).
        is_weights: optional [B, T] truncated importance weights (`off_policy.py`): each
            token's gradient is scaled by its weight; the logged loss keeps its value.
        prepared: this micro-batch's rows of `prepare_loss_inputs(...)` for the whole batch;
            None computes it from this batch (with `seed` and `process_group`).

    Returns:
        PolicyLossOutput(loss, metrics): metrics are floats, "policy/..." for this call
        (clip and dual-clip fractions, approx KL from pi_old to pi, ratio), plus
        `prepared.metrics`.
    """
    spec = as_spec(spec, options)
    registered = lookup_loss(spec.name)
    if prepared is None:
        prepared = prepare_loss_inputs(
            spec, old_logprobs, advantages, mask, group_ids, seed=seed,
            process_group=process_group,
        )  # fmt: skip
    elif seed is not None or process_group is not None:
        raise ValueError("seed and process_group were fixed when `prepared` was computed")
    B, T = logprobs.shape
    if old_logprobs.shape != (B, T) or mask.shape != (B, T) or advantages.shape != (B,):
        raise ValueError(
            f"expected old_logprobs and mask [{B}, {T}] and advantages [{B}] to match logprobs; "
            f"got {tuple(old_logprobs.shape)}, {tuple(mask.shape)}, {tuple(advantages.shape)}"
        )
    if prepared.name != spec.name:
        raise ValueError(f"prepared inputs are for {prepared.name!r}, not {spec.name!r}")
    for t in (prepared.token_weights, prepared.kl_penalty):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"prepared rows have shape {tuple(t.shape)} but logprobs {tuple(logprobs.shape)}:"
                " pass prepared.rows(index) with the micro-batch's row index"
            )
    m = float_mask(mask)
    logp = logprobs.to(torch.float32)
    if is_weights is not None:
        logp = weight_gradient(logp, is_weights)
    log_ratio = ((logp - old_logprobs.to(torch.float32)) * m).clamp(
        -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    ratio = torch.exp(log_ratio)
    n = float(m.sum())
    x = LossInputs(
        logp, log_ratio, ratio, advantages.detach().to(torch.float32)[:, None], m, n, prepared,
        spec,
    )  # fmt: skip
    token_loss, metrics, clipped = TokenLoss(*registered.token_loss(x))
    pg_loss = aggregate(token_loss, m, spec.loss_agg, prepared)
    loss = pg_loss
    safe_n = max(n, 1.0)
    with torch.no_grad():
        ratio_sum = float(torch.linalg.vecdot(ratio, m).sum())
        metrics.update({
            "policy/loss": float(pg_loss.detach()),
            "policy/tokens": n,
            "policy/ratio_mean": ratio_sum / safe_n,
            "policy/ratio_max": float((ratio * m).max()) if n else 0.0,
            # k3 estimate of KL(pi_old || pi) under pi_old's samples: E[r - 1 - log r].
            "policy/approx_kl": (ratio_sum - n - float(log_ratio.sum())) / safe_n,
        })  # fmt: skip
    if ref_logprobs is not None:
        kl = kl_estimate(logp, ref_logprobs.to(torch.float32), spec.kl_estimator)
        metrics[f"kl/ref_{spec.kl_estimator}"] = (
            float(torch.linalg.vecdot(kl.detach(), m).sum()) / safe_n
        )
        if spec.kl_coef:
            loss = loss + spec.kl_coef * aggregate(kl, m, spec.loss_agg, prepared)
    if entropy is not None:
        metrics["entropy/mean"] = float(torch.linalg.vecdot(entropy.detach(), m).sum()) / safe_n
        if spec.entropy_coef:
            loss = loss - spec.entropy_coef * aggregate(entropy, m, spec.loss_agg, prepared)
    metrics["loss/total"] = float(loss.detach())
    if not math.isfinite(metrics["loss/total"]):
        raise FloatingPointError(
            f"{spec.name} loss is {metrics['loss/total']}: check logprobs, old_logprobs, "
            "advantages (and ref_logprobs / entropy) for NaN or inf on valid tokens"
        )
    metrics.update(prepared.metrics)
    return PolicyLossOutput(loss, metrics, clipped)


def token_fields(spec: LossSpec | str, prepared: PreparedLoss, mask: Tensor) -> dict:
    """What loss `spec` shows the token inspector, from the batch's `prepared` statistics:
    every field of `INSPECTOR_FIELDS`, a [B, T] tensor where the loss has one, else None
    (the inspector's default: weight 1, not selected). `mask`: [B, T] bool."""
    name = spec if isinstance(spec, str) else spec.name
    fields = lookup_loss(name).token_fields(prepared, mask)
    return {field: fields.get(field) for field in INSPECTOR_FIELDS}


def shown_field(policy_loss: str) -> str:
    """The inspector column the page colours the tokens of `policy_loss` by at first ("cov"
    for a loss this process does not know, e.g. one registered by another program)."""
    return POLICY_LOSSES[policy_loss].shows if policy_loss in POLICY_LOSSES else "cov"
