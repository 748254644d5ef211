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
covariance get + 1.0 * |log r_t|; no ratio clipping). Their covariance is taken over the batch.

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

from cagrpo_ray.algo.stats import (
    RowLayout,
    Scope,
    covariance_quantiles,
    global_count,
    global_max,
    masked_quantiles,
    select_top_k,
)

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

SIGMA_FLOOR = 1e-8  # the contract: sigma below this means every weight is 1
# float32 resolves c to about 1e-7 of its magnitude: a sigma below this fraction of rms(c) is
# rounding noise around a constant c (e.g. two one-token responses, where c_1 = c_2 exactly).
SIGMA_RESOLUTION = 1e-5
LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here (as verl does), so exp never overflows


# ----------------------------------------------------------------------------------------------
# Token covariance and the CA-GRPO kernel weights
# ----------------------------------------------------------------------------------------------


def _float_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.float32 else mask.to(torch.float32)


def _covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor, scope: Scope):
    """c [B, T] float32 (0 off the mask) and |S| of each row's scope ([B] float64)."""
    logp = logprobs.detach().to(torch.float32) * mask  # [B, T]
    tokens_per_row = mask.sum(1).double()  # [B]
    size = scope.sum(tokens_per_row)  # |S|
    # Subtract a log-prob of the scope before averaging: float32 differences then keep their
    # precision when |log p| is far larger than its spread (e.g. -80 +- 1e-3).
    ref = scope.min(logp.amin(1))
    shifted = torch.addcmul(logp, mask, ref[:, None], value=-1.0)  # logp - ref on the mask
    a = advantages.detach().to(torch.float64)  # [B]
    sums = scope.sum(torch.stack([shifted.sum(1).double(), tokens_per_row * a], dim=1))
    mean_shifted = sums[:, 0] / size.clamp(min=1)
    a_centred = a - sums[:, 1] / size.clamp(min=1)  # A_i - mean_S A
    centred = torch.addcmul(shifted, mask, mean_shifted.float()[:, None], value=-1.0)
    return centred.mul_(a_centred.float()[:, None]), size  # c = (logp - mean) * (A - mean)


def _kernel_weights(c: Tensor, size: Tensor, mask: Tensor, scope: Scope):
    """w~ [B, T] from c; also sigma [B] and whether each row's scope is degenerate."""
    mean_c = scope.sum(c.sum(1).double()) / size.clamp(min=1)
    deviation = torch.addcmul(c, mask, mean_c.float()[:, None], value=-1.0)
    var = scope.sum(torch.linalg.vecdot(deviation, deviation).double()) / size.clamp(min=1)
    sigma = var.sqrt()
    rms = (var + mean_c**2).sqrt()
    degenerate = (sigma < SIGMA_FLOOR) | (sigma <= SIGMA_RESOLUTION * rms)
    # exp(-c^2 / (2 sigma^2)) = 2 ** (c^2 * scale): exp2 is several times faster than exp on CPU.
    scale = torch.where(degenerate, 0.0, -1.0 / (2.0 * math.log(2.0) * var.clamp(min=1e-300)))
    w = torch.exp2(c.square().mul_(scale.float()[:, None])).mul_(mask)
    total = scope.sum(w.sum(1).double())
    if bool(((total < 1e-30) & (size > 0)).any()):
        # Every |c| in some scope is far beyond sigma, so every w underflows. w~ does not change
        # if all w of a scope are multiplied by one constant: divide by the largest.
        floor = scope.min(torch.where(mask > 0, c.square(), torch.inf).amin(1))
        w = torch.exp2((c.square() - floor.float()[:, None]).mul_(scale.float()[:, None]))
        w = w.mul_(mask)
        total = scope.sum(w.sum(1).double())
    norm = torch.where(size > 0, size / total.clamp(min=1e-300), 0.0)  # |S| / sum_S w
    return w.mul_(norm.float()[:, None]), sigma, degenerate


def token_covariance(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    scope: str = "group",
    process_group=None,
) -> Tensor:
    """Each token's share of Cov(log pi, A): c_t = (logp_t - mean_S logp) * (A_i - mean_S A).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens.
        advantages: [B], one per response, broadcast to its tokens.
        mask: [B, T] bool or 0/1, the valid (response) tokens.
        group_ids: [B] prompt group of each response; needed for scope="group".
        scope: "group" (S = a prompt group's tokens) or "batch" (S = all tokens, all ranks of
            `process_group`).

    Returns:
        [B, T] float32, 0 off the mask, no gradient. mean_S c is the covariance over S.
    """
    with torch.no_grad():
        m = _float_mask(mask)
        s = Scope.of(scope, group_ids, logprobs.shape[0], logprobs.device, process_group)
        return _covariance(logprobs, advantages, m, s)[0]


def cagrpo_token_weights(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    scope: str = "group",
    process_group=None,
) -> Tensor:
    """CA-GRPO's normalized Gaussian-kernel weights w~ (arXiv 2605.11538), without gradient.

    Over the valid tokens S of each scope (each prompt group, or the whole batch):

        c = (logp - mean_S logp) * (A - mean_S A)        (A broadcast to its response's tokens)
        sigma = population std of c over S (ddof = 0);  sigma < 1e-8: every weight is 1
        w = exp(-c^2 / (2 sigma^2));  w~ = w * |S| / sum_S w

    Args:
        logprobs, mask: [B, T] (mask bool or 0/1); advantages: [B], one per response.
        group_ids: [B] prompt group of each response, needed for scope="group".
        scope: "group" or "batch".
        process_group: with scope="batch", the data-parallel group: the sums are all-reduced,
            so every rank's weights equal those of one process on the whole batch.

    Returns:
        [B, T] float32 w~, 0 outside the mask. Numerics: computed in float32 with float64
        scope sums; a sigma below float32's resolution of c (1e-5 * rms_S c) also counts as
        zero, and scopes where every w would underflow are normalized stably.
    """
    with torch.no_grad():
        m = _float_mask(mask)
        s = Scope.of(scope, group_ids, logprobs.shape[0], logprobs.device, process_group)
        c, size = _covariance(logprobs, advantages, m, s)
        return _kernel_weights(c, size, m, s)[0]


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


@dataclass(frozen=True)
class BatchInputs:
    """What a loss's prepare function sees: this rank's whole batch, before micro-batching."""

    old_logprobs: Tensor  # [B, T], no gradient
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] float32 0/1
    group_ids: Tensor | None  # [B]
    cov_scope: str
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    seed: int
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
    c, size = _covariance(b.old_logprobs, b.advantages, b.mask, scope)
    weights, sigma, degenerate = _kernel_weights(c, size, b.mask, scope)
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
        "cagrpo/sigma_mean": float((sigma * tokens_per_row).sum()) / n,
        "cagrpo/degenerate_frac": float((degenerate * tokens_per_row).sum()) / n,
    }
    return TokenStats(token_weights=weights, metrics=metrics)


def _uniform_keys(seed: int, layout: RowLayout, shape, device) -> Tensor:
    """[B, T] uniform numbers fixed by (seed, position in the global batch)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = torch.rand(layout.total_rows, layout.width, generator=g, dtype=torch.float64)
    B, T = shape
    return keys[layout.offset : layout.offset + B, :T].to(device)


def _clip_cov_prepare(b: BatchInputs) -> TokenStats:
    """Cui et al.'s Clip-Cov: a random clip_cov_ratio of all tokens, drawn from those whose
    covariance lies in (clip_cov_lb, clip_cov_ub), give no gradient (weight 0)."""
    scope = Scope.of("batch", None, b.mask.shape[0], b.mask.device, b.process_group)
    c, _ = _covariance(b.old_logprobs, b.advantages, b.mask, scope)
    valid = b.mask > 0
    eligible = valid & (c > b.clip_cov_lb) & (c < b.clip_cov_ub)
    k = max(int(b.clip_cov_ratio * b.num_tokens), 1)
    # The k eligible tokens with the smallest random keys: a uniformly random k-subset.
    keys = _uniform_keys(b.seed, b.layout, c.shape, c.device)
    chosen = select_top_k(-keys, eligible, k, b.layout, b.process_group)
    n = max(float(b.mask.sum()), 1.0)
    metrics = {
        "clip_cov/selected_frac": float(chosen.sum()) / n,
        "clip_cov/eligible_frac": float(eligible.sum()) / n,
    }
    return TokenStats(token_weights=b.mask.masked_fill(chosen, 0.0), metrics=metrics)


def _kl_cov_prepare(b: BatchInputs) -> TokenStats:
    """Cui et al.'s KL-Cov: the top kl_cov_ratio of tokens by covariance get a KL penalty."""
    scope = Scope.of("batch", None, b.mask.shape[0], b.mask.device, b.process_group)
    c, _ = _covariance(b.old_logprobs, b.advantages, b.mask, scope)
    k = max(int(b.kl_cov_ratio * b.num_tokens), 1) if b.num_tokens > 0 else 0
    chosen = select_top_k(c, b.mask > 0, k, b.layout, b.process_group)
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
    with torch.no_grad():
        active = (clipped > unclipped).to(torch.float32) * x.mask
        high = torch.linalg.vecdot(active, (x.ratio > 1.0).to(torch.float32)).sum()
        n = max(float(x.mask.sum()), 1.0)
        count = float(active.sum())
        metrics = {
            "policy/clip_frac": count / n,
            "policy/clip_frac_high": float(high) / n,
            "policy/clip_frac_low": (count - float(high)) / n,
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
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: Clip-Cov's fraction of tokens and band.
        kl_cov_ratio: KL-Cov's fraction of tokens.
        seed: Clip-Cov's random draw; None draws it from torch's default generator (rank 0's
            draw is used by all ranks). Same seed, same tokens, however the batch is split.
        max_response_length: Dr.GRPO's L; None uses the widest T over ranks.
        diagnostics: also compute batch statistics for the metrics (the covariance table over
            cov_scope, or over the batch without group_ids; kernel-weight quantiles); these
            sort the tokens, so they cost more than the loss itself.
        process_group: data-parallel group; statistics and normalisers then span all its ranks.

    Returns:
        PreparedLoss; pass `prepared.rows(index)` to `policy_loss` with each micro-batch.
    """
    registered = _lookup(name)
    B, T = old_logprobs.shape
    if advantages.shape != (B,) or mask.shape != (B, T):
        raise ValueError(
            f"expected advantages [{B}] and mask [{B}, {T}] to match old_logprobs; "
            f"got {tuple(advantages.shape)} and {tuple(mask.shape)}"
        )
    device = old_logprobs.device
    with torch.no_grad():
        m = _float_mask(mask)
        tokens_per_row = m.sum(1)
        num_tokens = global_count(float(tokens_per_row.sum()), device, process_group)
        num_seqs = global_count(float((tokens_per_row > 0).sum()), device, process_group)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
            if process_group is not None:
                seed = global_max(seed, device, process_group)
        layout = RowLayout.of(B, T, device, process_group)
        batch = BatchInputs(
            old_logprobs.detach(), advantages.detach(), m, group_ids, cov_scope,
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
    if prepared.name != name:
        raise ValueError(f"prepared inputs are for {prepared.name!r}, not {name!r}")
    for t in (prepared.token_weights, prepared.kl_penalty):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(
                f"prepared rows have shape {tuple(t.shape)} but logprobs {tuple(logprobs.shape)}:"
                " pass prepared.rows(index) with the micro-batch's row index"
            )
    m = _float_mask(mask)
    logp = logprobs.to(torch.float32)
    log_ratio = ((logp - old_logprobs.to(torch.float32)) * m).clamp(
        -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT
    )
    ratio = torch.exp(log_ratio)
    x = LossInputs(
        logp, log_ratio, ratio, advantages.detach().to(torch.float32)[:, None], m, prepared,
        clip_eps_low, clip_eps_high, kl_cov_coef,
    )  # fmt: skip
    token_loss, metrics = registered.token_loss(x)
    pg_loss = aggregate(token_loss, m, loss_agg, prepared)
    loss = pg_loss
    with torch.no_grad():
        n = float(m.sum())
        ratio_sum = float(torch.linalg.vecdot(ratio, m).sum())
        safe_n = max(n, 1.0)
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
