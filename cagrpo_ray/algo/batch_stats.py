"""What a loss needs from the whole batch, computed once before micro-batching.

Statistics over a whole scope (CA-GRPO's kernel weights, the Clip-Cov / KL-Cov selections) and
the loss normalisers are computed ONCE over the full batch, on every data-parallel rank
together, before micro-batching; each micro-batch's loss is then its share of the full-batch
loss (see `losses.py`). A loss's statistics function sees a `BatchInputs` and returns
`TokenStats`; `prepare_loss_inputs` (in `losses.py`) wraps them into a `PreparedLoss`.

Token covariances are computed at most once per scope and batch (`BatchInputs.covariance`):
the loss's statistics and the diagnostics share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor

from cagrpo_ray.algo.covariance import (
    ScopeCovariance,
    clip_cov_selection,
    kernel_weights,
    kl_cov_selection,
    scope_covariance,
)
from cagrpo_ray.algo.stats import RowLayout, Scope, covariance_quantiles, masked_quantiles


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
    covariance: Tensor | None = None  # [B, T] c over cov_scope (the diagnostics'), no gradient

    def rows(self, index: slice | Tensor) -> PreparedLoss:
        return replace(
            self,
            token_weights=_rows(self.token_weights, index),
            kl_penalty=_rows(self.kl_penalty, index),
            covariance=_rows(self.covariance, index),
        )

    def with_normalisers(self, num_tokens: float, num_seqs: float) -> PreparedLoss:
        """The same statistics with another (mini-)batch's token and sequence counts."""
        return replace(self, num_tokens=num_tokens, num_seqs=num_seqs)


@dataclass(frozen=True)
class BatchInputs:
    """What a loss's statistics function sees: this rank's whole batch, before micro-batching.

    `spec` is the loss's `LossSpec` (scope, kernel, Clip-Cov / KL-Cov ratios and bounds).
    """

    spec: object  # LossSpec (typed loosely: losses.py imports this module)
    old_logprobs: Tensor  # [B, T], no gradient
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] float32 0/1
    group_ids: Tensor | None  # [B]
    seed: int | None  # Clip-Cov's draw; None: from torch's default generator
    num_tokens: float  # valid tokens over all ranks
    layout: RowLayout
    process_group: object | None
    diagnostics: bool
    _covariances: dict = field(default_factory=dict, repr=False)

    def scope(self, kind: str) -> Scope:
        device = self.mask.device
        return Scope.of(kind, self.group_ids, self.mask.shape[0], device, self.process_group)

    def covariance(self, kind: str) -> tuple[Scope, ScopeCovariance]:
        """The scope `kind` ("group" or "batch") and its token covariances, computed once."""
        if kind not in self._covariances:
            scope = self.scope(kind)
            cov = scope_covariance(self.old_logprobs, self.advantages, self.mask, scope)
            self._covariances[kind] = (scope, cov)
        return self._covariances[kind]


class TokenStats(NamedTuple):
    token_weights: Tensor | None = None
    kl_penalty: Tensor | None = None
    metrics: dict[str, float] = {}


def no_statistics(b: BatchInputs) -> TokenStats:
    return TokenStats()


def cagrpo_statistics(b: BatchInputs) -> TokenStats:
    """CA-GRPO's w~ over `spec.cov_scope`, of width `spec.cagrpo_kappa` sigma (or the
    ablations `unnormalized`, `ones`, and the one-sided `positive`, `negative`)."""
    kernel = b.spec.cagrpo_kernel
    scope, cov = b.covariance(b.spec.cov_scope)
    side = kernel if kernel in ("positive", "negative") else "both"
    weights, sigma, degenerate = kernel_weights(
        cov, b.mask, scope, kernel != "unnormalized", b.spec.cagrpo_kappa, side
    )
    if kernel == "ones":  # ablation: the kernel frozen at 1 is GRPO, bit for bit
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


def clip_cov_statistics(b: BatchInputs) -> TokenStats:
    """Cui et al.'s Clip-Cov: the selected tokens get weight 0, so no gradient."""
    s = b.spec
    c = b.covariance("batch")[1].c
    chosen, eligible = clip_cov_selection(
        c, b.mask, s.clip_cov_ratio, s.clip_cov_lb, s.clip_cov_ub, b.num_tokens, b.seed,
        b.layout, b.process_group,
    )  # fmt: skip
    n = max(float(b.mask.sum()), 1.0)
    metrics = {
        "clip_cov/selected_frac": float(chosen.sum()) / n,
        "clip_cov/eligible_frac": float(eligible.sum()) / n,
    }
    return TokenStats(token_weights=b.mask.masked_fill(chosen, 0.0), metrics=metrics)


def kl_cov_statistics(b: BatchInputs) -> TokenStats:
    """Cui et al.'s KL-Cov: the selected tokens get kl_cov_coef * |log r| added."""
    c = b.covariance("batch")[1].c
    chosen = kl_cov_selection(
        c, b.mask, b.spec.kl_cov_ratio, b.num_tokens, b.layout, b.process_group
    )
    n = max(float(b.mask.sum()), 1.0)
    metrics = {"kl_cov/selected_frac": float(chosen.sum()) / n}
    return TokenStats(kl_penalty=chosen.to(torch.float32), metrics=metrics)


def diagnostic_covariance(b: BatchInputs) -> Tensor:
    """[B, T] c centred over `spec.cov_scope` (over the batch without group ids), the loss's
    own covariances when it has them."""
    kind = b.spec.cov_scope if b.group_ids is not None else "batch"
    return b.covariance(kind)[1].c


def covariance_diagnostics(b: BatchInputs) -> dict[str, float]:
    """Mean, std and the paper's quantile table of c over this rank's tokens (see
    `diagnostic_covariance`)."""
    c = diagnostic_covariance(b)
    n = max(float(b.mask.sum(1).sum()), 1.0)
    mean = float(c.sum()) / n
    metrics = {
        "cov/mean": mean,
        "cov/std": math.sqrt(max(float(c.square().sum()) / n - mean**2, 0.0)),
    }
    table = covariance_quantiles(c, b.mask)
    metrics.update({f"cov/{key}": value for key, value in table.items()})
    return metrics
