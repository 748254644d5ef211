"""Which tokens matter, decided once over a whole token set: covariances and kernel weights.

Every function here sees the whole batch (every data-parallel rank through a process group),
never a micro-batch, and carries no gradient:

    token_covariance       c_t = (log pi(o_t) - mean_S log pi) * (A_i - mean_S A)
    cagrpo_token_weights   CA-GRPO's Gaussian-kernel weights w~ (arXiv 2605.11538)
    clip_cov_selection     Clip-Cov's random tokens in a covariance band (Cui et al. 2025)
    kl_cov_selection       KL-Cov's top-covariance tokens (Cui et al. 2025)

S is a scope (`stats.Scope`): the valid tokens of a prompt group, or of the batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from cagrpo_ray.algo.stats import RowLayout, Scope, float_mask, global_max, select_top_k

SIGMA_FLOOR = 1e-8  # the contract: sigma below this means every weight is 1
# float32 resolves c to about 1e-7 of its magnitude: a sigma below this fraction of rms(c) is
# rounding noise around a constant c (e.g. two one-token responses, where c_1 = c_2 exactly).
SIGMA_RESOLUTION = 1e-5


class ScopeCovariance(NamedTuple):
    c: Tensor  # [B, T] float32 token covariances, 0 off the mask
    size: Tensor  # [num_scopes] float64, |S|
    mean: Tensor  # [num_scopes] float64, mean_S c (the covariance of log pi and A over S)


def scope_covariance(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, scope: Scope
) -> ScopeCovariance:
    """c_t = (logp_t - mean_S logp) * (A_i - mean_S A) for a float32 0/1 `mask`, no gradient.

    Padded positions of `logprobs` must be finite (they are multiplied by 0)."""
    centred = logprobs.detach().to(torch.float32) * mask  # [B, T], becomes c in place
    a = advantages.detach().to(torch.float64)  # [B]
    tokens = mask.sum(1).double()  # [B]
    sums = scope.totals(torch.stack([tokens, centred.sum(1).double(), tokens * a], dim=1))
    size = sums[:, 0]  # |S|
    per_token = 1.0 / size.clamp(min=1)
    first_mean, mean_a = scope.rows(sums[:, 1:] * per_token[:, None]).unbind(1)
    first_mean = first_mean.float()
    # A_i - mean_S A in float64: advantages of different groups can differ only in their last
    # float32 bits (e.g. +-0.7070988 and +-0.7071058), and a float32 difference would be noise.
    a_centred = (a - mean_a).float()
    # mean_S logp in two passes: the first is only as exact as float32 is at |log p|, coarse
    # when |log p| >> its spread (e.g. -80 +- 1e-3); averaging what it leaves recovers the rest.
    centred.addcmul_(mask, first_mean[:, None], value=-1.0)
    left = centred.sum(1).double()
    sums = scope.totals(torch.stack([left, left * a_centred.double()], 1)) * per_token[:, None]
    # subtracting `rest` leaves sum_S c unchanged (sum_S (A - mean_S A) = 0 over tokens)
    rest, mean_c = sums.unbind(1)
    centred.addcmul_(mask, scope.rows(rest).float()[:, None], value=-1.0)  # logp - mean_S logp
    c = centred.mul_(a_centred[:, None])  # (logp - mean_S logp) * (A - mean_S A)
    return ScopeCovariance(c, size, mean_c)


class KernelWeights(NamedTuple):
    weights: Tensor  # [B, T] float32 w~, 0 off the mask
    sigma: Tensor  # [num_scopes] float64 std_S(c)
    degenerate: Tensor  # [num_scopes] bool: sigma counts as 0, every weight is 1


KERNEL_SIDES = ("both", "positive", "negative")


def kernel_weights(
    cov: ScopeCovariance,
    mask: Tensor,
    scope: Scope,
    normalize: bool = True,
    kappa: float = 1.0,
    side: str = "both",
) -> KernelWeights:
    """CA-GRPO's w~ from the token covariances of `scope_covariance` (see cagrpo_token_weights).

    normalize=False returns the raw kernel w = exp(-c^2 / (2 sigma^2)) (an ablation: the
    loss then shrinks by mean_S w instead of keeping the scope's total weight). kappa widens
    the kernel to kappa * sigma; side "positive" ("negative") applies it only to tokens with
    c > 0 (c < 0), the others keep w = 1 before the normalization."""
    if side not in KERNEL_SIDES:
        raise ValueError(f"side {side!r} is not one of {', '.join(KERNEL_SIDES)}")
    if not kappa > 0:
        raise ValueError(f"kappa must be positive, got {kappa}")
    c, size, mean_c = cov
    deviation = torch.addcmul(c, mask, scope.rows(mean_c).float()[:, None], value=-1.0)
    var = scope.totals(deviation.square_().sum(1).double()[:, None])[:, 0] / size.clamp(min=1)
    sigma = var.sqrt()
    degenerate = (sigma < SIGMA_FLOOR) | (sigma <= SIGMA_RESOLUTION * (var + mean_c**2).sqrt())
    # exp(-c^2 / (2 kappa^2 sigma^2)) = 2 ** (c^2 * scale): exp2 is several times faster than
    # exp on CPU.
    width = 2.0 * math.log(2.0) * kappa**2
    scale = torch.where(degenerate, 0.0, -1.0 / (width * var.clamp(min=1e-300)))
    scale = scope.rows(scale).float()[:, None]
    exponent = torch.mul(c, c, out=deviation).mul_(scale)
    if side != "both":  # the other side's tokens keep w = 1 (exponent 0)
        exponent.masked_fill_(c <= 0 if side == "positive" else c >= 0, 0.0)
    w = exponent.exp2().mul_(mask)
    if not normalize:
        return KernelWeights(w, sigma, degenerate)
    total = scope.totals(w.sum(1).double()[:, None])[:, 0]
    underflow = (total < 1e-30) & (size > 0)
    if bool(underflow.any()):
        # Every |c| in some scope is far beyond sigma, so every w underflows (then every token
        # of the scope is on the kernel's side: the others have w = 1). w~ does not change if
        # all w of a scope are multiplied by one constant: divide those scopes' by the largest.
        largest = torch.where(mask > 0, exponent, -torch.inf).amax(1)  # [B]
        floor = torch.where(underflow, -scope.minima(-largest), 0.0)  # a scope's largest
        # clamp: off the mask the exponent is 0, above the floor, and exp2 of a large positive
        # number would be inf, and inf * 0 NaN
        w = (exponent - scope.rows(floor).float()[:, None]).clamp_(max=0.0)
        w = w.exp2_().mul_(mask)
        total = scope.totals(w.sum(1).double()[:, None])[:, 0]
    norm = torch.where(size > 0, size / total.clamp(min=1e-300), 0.0)  # |S| / sum_S w
    return KernelWeights(w.mul_(scope.rows(norm).float()[:, None]), sigma, degenerate)


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
        m = float_mask(mask)
        s = Scope.of(scope, group_ids, logprobs.shape[0], logprobs.device, process_group)
        return scope_covariance(logprobs, advantages, m, s).c


def cagrpo_token_weights(
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor | None = None,
    scope: str = "group",
    process_group=None,
    kappa: float = 1.0,
    side: str = "both",
) -> Tensor:
    """CA-GRPO's normalized Gaussian-kernel weights w~ (arXiv 2605.11538), without gradient.

    Over the valid tokens S of each scope (each prompt group, or the whole batch):

        c = (logp - mean_S logp) * (A - mean_S A)        (A broadcast to its response's tokens)
        sigma = population std of c over S (ddof = 0);  sigma < 1e-8: every weight is 1
        w = exp(-c^2 / (2 kappa^2 sigma^2));  w~ = w * |S| / sum_S w

    kappa = 1 is the paper's kernel; kappa -> infinity is GRPO (every weight 1). side
    "positive" ("negative") keeps w = 1 for tokens with c <= 0 (c >= 0): the kernel acts on
    one tail only (an ablation).

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
        m = float_mask(mask)
        s = Scope.of(scope, group_ids, logprobs.shape[0], logprobs.device, process_group)
        cov = scope_covariance(logprobs, advantages, m, s)
        return kernel_weights(cov, m, s, kappa=kappa, side=side).weights


def _uniform_keys(seed: int, layout: RowLayout, shape, device) -> Tensor:
    """[B, T] uniform numbers fixed by (seed, position in the global batch)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    keys = torch.rand(layout.total_rows, layout.width, generator=g, dtype=torch.float64)
    B, T = shape
    return keys[layout.offset : layout.offset + B, :T].to(device)


def clip_cov_selection(
    c: Tensor,
    mask: Tensor,
    ratio: float,
    lb: float,
    ub: float,
    num_tokens: float,
    seed: int | None,
    layout: RowLayout,
    process_group=None,
) -> tuple[Tensor, Tensor]:
    """Clip-Cov's tokens: max(1, ratio * num_tokens) drawn uniformly at random among the
    valid tokens with lb < c < ub (batch-scope c, all ranks). Returns (chosen, eligible),
    both [B, T] bool. The same seed draws the same tokens however the batch is split; None
    draws a seed from torch's default generator (one rank's draw, used by all).

    Cui et al. draw among tokens not already clipped by PPO at the current ratio; drawn here
    before any update (ratio 1), none is.
    """
    eligible = (mask > 0) & (c > lb) & (c < ub)
    k = max(int(ratio * num_tokens), 1)
    if seed is None:
        seed = global_max(int(torch.randint(0, 2**62, ())), c.device, process_group)
    # the k eligible tokens with the smallest random keys: a uniformly random k-subset
    keys = _uniform_keys(seed, layout, c.shape, c.device)
    return select_top_k(-keys, eligible, k, layout, process_group), eligible


def kl_cov_selection(
    c: Tensor, mask: Tensor, ratio: float, num_tokens: float, layout: RowLayout, process_group=None
) -> Tensor:
    """KL-Cov's tokens: the max(1, ratio * num_tokens) valid tokens with the largest c
    (batch-scope c, all ranks), ties to the earlier token. Returns [B, T] bool."""
    k = max(int(ratio * num_tokens), 1) if num_tokens > 0 else 0
    return select_top_k(c, mask > 0, k, layout, process_group)
