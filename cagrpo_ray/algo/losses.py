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

Baselines in the same registry: `grpo` (PPO-clip with separate eps_low / eps_high, i.e. DAPO's
clip-higher), and from Cui et al. 2025 ("The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models"), with the defaults of their verl implementation: `clip_cov` (the
surrogate of a random clip_cov_ratio = 2e-4 of the tokens whose covariance lies in (1, 5) is
zeroed, so they give no gradient) and `kl_cov` (the top kl_cov_ratio = 2e-4 of tokens by
covariance get + 1.0 * |log r_t|; no ratio clipping). Their covariance is taken over the batch,
with pi_old's log-probs like CA-GRPO's (verl uses pi's, equal on the first, on-policy pass).

Computed once per batch, then micro-batched
-------------------------------------------
Statistics over a whole scope (the kernel weights, the Clip-Cov / KL-Cov selections) and the
loss normalisers are computed ONCE over the full batch, on every data-parallel rank together,
before micro-batching; each micro-batch's loss is then its share of the full-batch loss:

    prepared = prepare_loss_inputs("cagrpo", old_logprobs, advantages, mask, group_ids,
                                   process_group=dp_group)        # this rank's whole batch
    for rows in micro_batches:                                     # slices or index tensors
        out = policy_loss("cagrpo", new_logprobs(rows), old_logprobs[rows], advantages[rows],
                          mask[rows], prepared=prepared.rows(rows))
        out.loss.backward()                                        # accumulate, don't average

Summed over micro-batches and ranks, the gradients equal those of one call on the whole batch
(verl computes these statistics per micro-batch, so its update changes with the micro-batch
size). Data-parallel engines that *average* gradients over ranks need loss * world_size.

Adding a loss is one function and one name:

    @register_policy_loss("pg")                         # prepare=... for batch statistics
    def pg(x: LossInputs) -> tuple[Tensor, dict[str, float]]:
        return -x.advantages * x.ratio, {}              # [B, T] per-token loss, metrics
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor

from cagrpo_ray.algo.covariance import (
    cagrpo_token_weights,
    clip_cov_selection,
    kernel_weights,
    kl_cov_selection,
    scope_covariance,
    token_covariance,
)
from cagrpo_ray.algo.stats import (
    RowLayout,
    Scope,
    covariance_quantiles,
    float_mask,
    global_count,
    masked_quantiles,
)

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "BatchInputs",
    "LossInputs",
    "PolicyLossOutput",
    "PreparedLoss",
    "TokenStats",
    "aggregate",
    "cagrpo_token_weights",
    "policy_loss",
    "ppo_clip",
    "prepare_loss_inputs",
    "register_policy_loss",
    "token_covariance",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here (as verl does), so exp never overflows


# ----------------------------------------------------------------------------------------------
# Computed once per batch: PreparedLoss
# ----------------------------------------------------------------------------------------------


def _rows(t: Tensor | None, index) -> Tensor | None:
    return None if t is None else t[index]


@dataclass(frozen=True)
class PreparedLoss:
    """What a loss needs from the whole batch, computed once by `prepare_loss_inputs`.

    Slice it like the micro-batch with `.rows(index)`; the normalisers stay global.
    """

    name: str
    num_tokens: float  # valid tokens in the whole batch, all ranks (token-mean's divisor)
    num_seqs: float  # responses with at least one valid token, whole batch, all ranks
    horizon: int  # Dr.GRPO's constant length L (seq-mean-token-sum-norm divides by B * L)
    token_weights: Tensor | None = None  # [B, T]: multiplies A_i per token (w~; Clip-Cov's 0/1)
    kl_penalty: Tensor | None = None  # [B, T] 0/1: KL-Cov's penalized tokens
    metrics: dict[str, float] = field(default_factory=dict)  # batch-level statistics

    def rows(self, index: slice | Tensor) -> PreparedLoss:
        return replace(
            self,
            token_weights=_rows(self.token_weights, index),
            kl_penalty=_rows(self.kl_penalty, index),
        )


CAGRPO_KERNELS = ("normalized", "unnormalized", "ones")


@dataclass(frozen=True)
class BatchInputs:
    """What a loss's prepare function sees: this rank's whole batch, before micro-batching."""

    old_logprobs: Tensor  # [B, T], no gradient
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] float32 0/1
    group_ids: Tensor | None  # [B]
    cov_scope: str
    cagrpo_kernel: str  # "normalized" (the paper's w~), "unnormalized" (w) or "ones"
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    seed: int | None  # Clip-Cov's draw; None: from torch's default generator
    num_tokens: float  # valid tokens over all ranks
    layout: RowLayout
    process_group: object | None
    diagnostics: bool


class TokenStats(NamedTuple):
    token_weights: Tensor | None = None
    kl_penalty: Tensor | None = None
    metrics: dict[str, float] = {}


def _no_statistics(b: BatchInputs) -> TokenStats:
    return TokenStats()


def _cagrpo_prepare(b: BatchInputs) -> TokenStats:
    scope = Scope.of(b.cov_scope, b.group_ids, b.mask.shape[0], b.mask.device, b.process_group)
    cov = scope_covariance(b.old_logprobs, b.advantages, b.mask, scope)
    weights, sigma, degenerate = kernel_weights(
        cov, b.mask, scope, normalize=b.cagrpo_kernel == "normalized"
    )
    if b.cagrpo_kernel == "ones":  # ablation: the kernel frozen at 1 is GRPO, bit for bit
        weights = b.mask.clone()
    if not b.diagnostics:
        return TokenStats(token_weights=weights)
    valid = b.mask > 0
    w = weights[valid]
    tokens_per_row = b.mask.sum(1).double()
    n = max(float(tokens_per_row.sum()), 1.0)
    metrics = {
        "cagrpo/weight_min": float(w.min()) if w.numel() else 0.0,
        "cagrpo/weight_max": float(w.max()) if w.numel() else 0.0,
        "cagrpo/weight_mean": float(w.sum()) / n,
        "cagrpo/weight_p01": masked_quantiles(weights, valid, [0.01])[0],
        "cagrpo/weight_frac_below_0.5": float((w < 0.5).sum()) / n,
        "cagrpo/sigma_mean": float((scope.rows(sigma) * tokens_per_row).sum()) / n,
        "cagrpo/degenerate_frac": float((scope.rows(degenerate) * tokens_per_row).sum()) / n,
    }
    return TokenStats(token_weights=weights, metrics=metrics)


def _clip_cov_prepare(b: BatchInputs) -> TokenStats:
    """Cui et al.'s Clip-Cov: the selected tokens get weight 0, so no gradient."""
    scope = Scope.of("batch", None, b.mask.shape[0], b.mask.device, b.process_group)
    c = scope_covariance(b.old_logprobs, b.advantages, b.mask, scope).c
    chosen, eligible = clip_cov_selection(
        c, b.mask, b.clip_cov_ratio, b.clip_cov_lb, b.clip_cov_ub, b.num_tokens, b.seed,
        b.layout, b.process_group,
    )  # fmt: skip
    n = max(float(b.mask.sum()), 1.0)
    metrics = {
        "clip_cov/selected_frac": float(chosen.sum()) / n,
        "clip_cov/eligible_frac": float(eligible.sum()) / n,
    }
    return TokenStats(token_weights=b.mask.masked_fill(chosen, 0.0), metrics=metrics)


def _kl_cov_prepare(b: BatchInputs) -> TokenStats:
    """Cui et al.'s KL-Cov: the selected tokens get kl_cov_coef * |log r| added."""
    scope = Scope.of("batch", None, b.mask.shape[0], b.mask.device, b.process_group)
    c = scope_covariance(b.old_logprobs, b.advantages, b.mask, scope).c
    chosen = kl_cov_selection(c, b.mask, b.kl_cov_ratio, b.num_tokens, b.layout, b.process_group)
    n = max(float(b.mask.sum()), 1.0)
    metrics = {"kl_cov/selected_frac": float(chosen.sum()) / n}
    return TokenStats(kl_penalty=chosen.to(torch.float32), metrics=metrics)


# ----------------------------------------------------------------------------------------------
# The registry and the losses
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossInputs:
    """What a registered loss sees for one micro-batch; every tensor [B, T] unless noted."""

    logprobs: Tensor  # log pi(o_t), with gradient
    log_ratio: Tensor  # log r_t = log pi - log pi_old, 0 off the mask, clamped to +-20
    ratio: Tensor  # r_t
    advantages: Tensor  # [B, 1] A_i
    mask: Tensor  # float32 0/1
    num_valid: float  # valid tokens in this micro-batch
    prepared: PreparedLoss  # this micro-batch's rows of the batch statistics
    clip_eps_low: float
    clip_eps_high: float
    kl_cov_coef: float


TokenLossFn = Callable[[LossInputs], tuple[Tensor, dict[str, float]]]
PrepareFn = Callable[[BatchInputs], TokenStats]


@dataclass(frozen=True)
class RegisteredLoss:
    token_loss: TokenLossFn
    prepare: PrepareFn


POLICY_LOSSES: dict[str, RegisteredLoss] = {}


def register_policy_loss(name: str, prepare: PrepareFn = _no_statistics):
    """Register `fn(x: LossInputs) -> (per-token loss [B, T], metrics)` under `name`.

    `prepare(b: BatchInputs) -> TokenStats` computes what the loss needs from the whole batch
    (e.g. token weights); it runs once per batch in `prepare_loss_inputs`.
    """

    def decorator(fn: TokenLossFn) -> TokenLossFn:
        POLICY_LOSSES[name] = RegisteredLoss(fn, prepare)
        return fn

    return decorator


def _lookup(name: str) -> RegisteredLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is not one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def ppo_clip(x: LossInputs, advantages: Tensor) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip with asymmetric range (DAPO clip-higher), per token:

        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))

    `advantages` is [B, 1] or [B, T]. Metrics: the fraction of valid tokens where the clip is
    active (no gradient), split into r_t > 1 + eps_high (A > 0) and r_t < 1 - eps_low (A < 0).
    """
    unclipped = -advantages * x.ratio
    clipped = -advantages * x.ratio.clamp(1.0 - x.clip_eps_low, 1.0 + x.clip_eps_high)
    with torch.no_grad():  # off the mask r_t = 1, so the clip is never active there
        active = torch.gt(clipped, unclipped)
        count = float(active.sum())
        high = float(active.logical_and_(x.ratio > 1.0).sum())
        n = max(x.num_valid, 1.0)
        metrics = {
            "policy/clip_frac": count / n,
            "policy/clip_frac_high": high / n,
            "policy/clip_frac_low": (count - high) / n,
        }
    return torch.maximum(unclipped, clipped), metrics


@register_policy_loss("grpo")
def grpo(x: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """GRPO / DAPO: PPO-clip on the response advantage A_i."""
    return ppo_clip(x, x.advantages)


@register_policy_loss("cagrpo", prepare=_cagrpo_prepare)
def cagrpo(x: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """CA-GRPO: PPO-clip with A_i replaced by the constant w~_t * A_i."""
    return ppo_clip(x, x.advantages * x.prepared.token_weights)


@register_policy_loss("clip_cov", prepare=_clip_cov_prepare)
def clip_cov(x: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov: PPO-clip, with the selected tokens' surrogate set to 0 (weight 0)."""
    return ppo_clip(x, x.advantages * x.prepared.token_weights)


@register_policy_loss("kl_cov", prepare=_kl_cov_prepare)
def kl_cov(x: LossInputs) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov: L_t = -A_i r_t + kl_cov_coef * |log r_t| on the selected tokens (no clipping)."""
    penalty = x.prepared.kl_penalty * x.log_ratio.abs()
    with torch.no_grad():
        n = max(float(x.prepared.kl_penalty.mul(x.mask).sum()), 1.0)
        metrics = {"kl_cov/abs_log_ratio": float(penalty.sum()) / n}
    return -x.advantages * x.ratio + x.kl_cov_coef * penalty, metrics


# ----------------------------------------------------------------------------------------------
# Aggregation and the public entry points
# ----------------------------------------------------------------------------------------------


def aggregate(values: Tensor, mask: Tensor, mode: str, prepared: PreparedLoss) -> Tensor:
    """Reduce per-token values [B, T] to this micro-batch's share of the batch loss.

        token-mean:               sum_{i,t} m_it l_it / N_tokens
        seq-mean-token-mean:      sum_i (sum_t m_it l_it / sum_t m_it) / N_seqs
        seq-mean-token-sum-norm:  sum_{i,t} m_it l_it / (N_seqs * L)            (Dr.GRPO)

    N_tokens, N_seqs and L come from `prepared` and count the whole batch over all ranks.
    """
    if mode == "token-mean":
        return torch.linalg.vecdot(values, mask).sum() / max(prepared.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = torch.linalg.vecdot(values, mask) / mask.sum(1).clamp(min=1.0)
        return per_seq.sum() / max(prepared.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        total = torch.linalg.vecdot(values, mask).sum()
        return total / max(prepared.num_seqs * prepared.horizon, 1.0)
    raise ValueError(f"loss_agg {mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")


def prepare_loss_inputs(
    name: str,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    cov_scope: str = "group",
    cagrpo_kernel: str = "normalized",
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 2e-4,
    seed: int | None = None,
    max_response_length: int | None = None,
    diagnostics: bool = True,
    process_group=None,
) -> PreparedLoss:
    """Everything loss `name` needs from the whole batch, computed once before micro-batching.

    Args:
        old_logprobs: [B, T] log pi_old of the sampled tokens (behavior or recomputed).
        advantages: [B], one per response.  mask: [B, T] bool or 0/1.
        group_ids: [B] prompt group of each response (needed for cov_scope="group").
        cov_scope: CA-GRPO's token set S, "group" or "batch". Clip-Cov and KL-Cov always
            select over the batch, as their reference implementation does.
        cagrpo_kernel: CA-GRPO's weights: "normalized" (w~, the paper's), or the ablations
            "unnormalized" (w) and "ones" (every weight 1: equal to grpo).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov's fraction of tokens and band.
        kl_cov_ratio: KL-Cov's fraction of tokens.
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
    registered = _lookup(name)
    if cagrpo_kernel not in CAGRPO_KERNELS:
        raise ValueError(
            f"cagrpo_kernel {cagrpo_kernel!r} is not one of {', '.join(CAGRPO_KERNELS)}"
        )
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
            old_logprobs.detach(), advantages.detach(), m, group_ids, cov_scope, cagrpo_kernel,
            clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, seed, num_tokens, layout,
            process_group, diagnostics,
        )  # fmt: skip
        stats = registered.prepare(batch)
        metrics = dict(stats.metrics)
        if diagnostics:
            scope = cov_scope if group_ids is not None else "batch"
            c = token_covariance(old_logprobs, advantages, m, group_ids, scope, process_group)
            n = max(float(tokens_per_row.sum()), 1.0)
            mean = float(c.sum()) / n
            metrics["cov/mean"] = mean
            metrics["cov/std"] = math.sqrt(max(float(c.square().sum()) / n - mean**2, 0.0))
            table = covariance_quantiles(c, m)
            metrics.update({f"cov/{key}": value for key, value in table.items()})
    horizon = max_response_length or layout.width
    return PreparedLoss(
        name, num_tokens, num_seqs, horizon, stats.token_weights, stats.kl_penalty, metrics
    )


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: Tensor  # scalar, with gradient
    metrics: dict[str, float]


def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimate of KL(pi || pi_ref) per token (Schulman 2020): e^d - d - 1, d = ref - logp."""
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(d) - d - 1.0


def policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    loss_agg: str = "token-mean",
    kl_cov_coef: float = 1.0,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    prepared: PreparedLoss | None = None,
    **prepare_options,
) -> PolicyLossOutput:
    """Policy loss `name` ("grpo", "cagrpo", "clip_cov", "kl_cov") for one (micro-)batch.

        loss = agg(L_t) + kl_coef * agg(k3(pi || pi_ref)) - entropy_coef * agg(H_t)

    Args:
        logprobs: [B, T] log pi(o_t) under the policy being trained, with gradient.
        old_logprobs: [B, T] log pi_old(o_t).  advantages: [B].  mask: [B, T] bool or 0/1.
        group_ids: [B] prompt groups, for cov_scope="group" when `prepared` is None.
        clip_eps_low, clip_eps_high: PPO clip range [1 - eps_low, 1 + eps_high].
        loss_agg: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum-norm" (Dr.GRPO).
        kl_cov_coef: KL-Cov's coefficient of |log r| on its selected tokens.
        ref_logprobs, kl_coef: optional k3 KL to a reference policy (off by default).
        entropy, entropy_coef: optional [B, T] token entropies (with gradient) and bonus.
        prepared: this micro-batch's rows of `prepare_loss_inputs(...)` for the whole batch;
            None computes it from this batch, with `prepare_options` (cov_scope, seed,
            process_group, ...; see prepare_loss_inputs).

    Returns:
        PolicyLossOutput(loss, metrics): metrics are floats, "policy/..." for this call
        (clip fractions, approx KL from pi_old to pi, ratio), plus `prepared.metrics`.
    """
    registered = _lookup(name)
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg {loss_agg!r} is not one of {', '.join(LOSS_AGG_MODES)}")
    if prepared is None:
        prepared = prepare_loss_inputs(
            name, old_logprobs, advantages, mask, group_ids, **prepare_options
        )
    elif prepare_options:
        raise ValueError(
            f"{sorted(prepare_options)} belong to prepare_loss_inputs; they were fixed when "
            "`prepared` was computed"
        )
    B, T = logprobs.shape
    if old_logprobs.shape != (B, T) or mask.shape != (B, T) or advantages.shape != (B,):
        raise ValueError(
            f"expected old_logprobs and mask [{B}, {T}] and advantages [{B}] to match logprobs; "
            f"got {tuple(old_logprobs.shape)}, {tuple(mask.shape)}, {tuple(advantages.shape)}"
        )
    if prepared.name != name:
        raise ValueError(f"prepared inputs are for {prepared.name!r}, not {name!r}")
    for t in (prepared.token_weights, prepared.kl_penalty):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"prepared rows have shape {tuple(t.shape)} but logprobs {tuple(logprobs.shape)}:"
                " pass prepared.rows(index) with the micro-batch's row index"
            )
    m = float_mask(mask)
    logp = logprobs.to(torch.float32)
    log_ratio = ((logp - old_logprobs.to(torch.float32)) * m).clamp(
        -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    ratio = torch.exp(log_ratio)
    n = float(m.sum())
    x = LossInputs(
        logp, log_ratio, ratio, advantages.detach().to(torch.float32)[:, None], m, n, prepared,
        clip_eps_low, clip_eps_high, kl_cov_coef,
    )  # fmt: skip
    token_loss, metrics = registered.token_loss(x)
    pg_loss = aggregate(token_loss, m, loss_agg, prepared)
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
        kl = _k3(logp, ref_logprobs.to(torch.float32))
        metrics["kl/ref_k3"] = float(torch.linalg.vecdot(kl.detach(), m).sum()) / safe_n
        if kl_coef:
            loss = loss + kl_coef * aggregate(kl, m, loss_agg, prepared)
    if entropy is not None:
        metrics["entropy/mean"] = float(torch.linalg.vecdot(entropy.detach(), m).sum()) / safe_n
        if entropy_coef:
            loss = loss - entropy_coef * aggregate(entropy, m, loss_agg, prepared)
    metrics["loss/total"] = float(loss.detach())
    if not math.isfinite(metrics["loss/total"]):
        raise FloatingPointError(
            f"{name} loss is {metrics['loss/total']}: check logprobs, old_logprobs, advantages "
            "(and ref_logprobs / entropy) for NaN or inf on valid tokens"
        )
    metrics.update(prepared.metrics)
    return PolicyLossOutput(loss, metrics)
