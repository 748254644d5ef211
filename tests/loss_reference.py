"""The paper's equations as the paper writes them: plain loops in float64, no speed tricks.

The readable version of `cagrpo_ray/algo/`: `advantages.py`, `covariance.py`, `off_policy.py` and
`losses.py`, and the reference that their tests compare against on random batches. Every
function takes numpy arrays (or float64 torch leaves where a gradient is wanted) and returns
float64. The fast kernels must agree with these within float32 rounding.

CA-GRPO (Wang, Liu, Zhou, Chen, ACL 2026, arXiv 2605.11538), over a token set S (the valid
tokens of one prompt group, or of the whole batch):

    c_t   = (log pi(o_t) - mean_S log pi) * (A_i - mean_S A)     t a token of response i
    sigma = std_S(c)                                             population std (ddof = 0)
    w_t   = exp(-c_t^2 / (2 sigma^2))                            1 for every t if sigma < 1e-8
    w~_t  = w_t * |S| / sum_S w                                  mean_S w~ = 1
    L_t   = max(-w~_t A_i r_t, -w~_t A_i clip(r_t, 1 - eps_low, 1 + eps_high))
    L_t   = min(L_t, -w~_t A_i c)          where w~_t A_i < 0 (dual-clip, c = clip_ratio_c)

with r_t = pi(o_t) / pi_old(o_t). Clip-Cov and KL-Cov (Cui et al. 2025) act on the tokens
with the largest c over the batch (see `policy_loss`). The KL to a reference policy and the
aggregation modes are in `kl_estimate` and `policy_loss`.
"""

from __future__ import annotations

import numpy as np
import torch

SIGMA_FLOOR = 1e-8


def group_advantages(rewards: np.ndarray, group_size: int, estimator: str = "grpo"):
    """GRPO: A_i = (r_i - mean(r)) / (std(r) + 1e-6) over each group of `group_size`
    (ddof = 1); Dr.GRPO (estimator "dr_grpo") keeps only r_i - mean(r)."""
    out = np.zeros(len(rewards))
    for start in range(0, len(rewards), group_size):
        r = np.asarray(rewards[start : start + group_size], dtype=np.float64)
        centred = r - r.mean()
        if estimator == "grpo":
            std = r.std(ddof=1) if len(r) > 1 else 0.0
            centred = centred / (std + 1e-6)
        out[start : start + group_size] = centred
    return out


def scopes(num_rows: int, group_ids, scope: str) -> list[list[int]]:
    """The rows of each token set S: one per prompt group, or one for the whole batch."""
    if scope == "batch":
        return [list(range(num_rows))]
    ids = [int(g) for g in group_ids]
    return [[i for i in range(num_rows) if ids[i] == g] for g in sorted(set(ids))]


def _tokens(rows: list[int], mask) -> list[tuple[int, int]]:
    return [(i, t) for i in rows for t in range(mask.shape[1]) if mask[i, t]]


def token_covariance(logp, adv, mask, group_ids, scope: str) -> np.ndarray:
    """c[i, t] = (logp[i, t] - mean_S logp) * (A_i - mean_S A) on valid tokens, 0 elsewhere."""
    c = np.zeros(mask.shape)
    for rows in scopes(mask.shape[0], group_ids, scope):
        tokens = _tokens(rows, mask)
        if not tokens:
            continue
        lp = np.array([float(logp[i, t]) for i, t in tokens])
        a = np.array([float(adv[i]) for i, _ in tokens])
        for (i, t), value in zip(tokens, (lp - lp.mean()) * (a - a.mean()), strict=True):
            c[i, t] = value
    return c


def kernel_weights(
    logp, adv, mask, group_ids, scope: str, normalize: bool = True, kappa=1.0, side="both"
) -> np.ndarray:
    """CA-GRPO's w~ (or the raw kernel w with normalize=False) on valid tokens, 0 elsewhere:
    w = exp(-c^2 / (2 kappa^2 sigma^2)) on the tokens of `side` ("both", "positive": c > 0,
    "negative": c < 0), 1 on the others."""
    c = token_covariance(logp, adv, mask, group_ids, scope)
    weights = np.zeros(mask.shape)
    for rows in scopes(mask.shape[0], group_ids, scope):
        tokens = _tokens(rows, mask)
        if not tokens:
            continue
        cs = np.array([c[i, t] for i, t in tokens])
        sigma = cs.std()
        if sigma < SIGMA_FLOOR:
            for i, t in tokens:
                weights[i, t] = 1.0
            continue
        on_side = {"both": np.ones(len(cs), bool), "positive": cs > 0, "negative": cs < 0}[side]
        exponent = np.where(on_side, -(cs**2) / (2 * kappa**2 * sigma**2), 0.0)
        if not normalize:
            w = np.exp(exponent)
        else:
            w = np.exp(exponent - exponent.max())  # a common factor of the scope cancels in w~
            w = w * len(tokens) / w.sum()
        for (i, t), value in zip(tokens, w, strict=True):
            weights[i, t] = value
    return weights


def truncated_is_weights(proximal, behavior, mask, cap: float) -> np.ndarray:
    """w_t = min(pi_prox(o_t) / mu(o_t), cap) on valid tokens, 0 elsewhere."""
    ratio = np.exp(np.minimum(np.asarray(proximal, np.float64) - behavior, 20.0))
    return np.where(mask, np.minimum(ratio, cap), 0.0)


def kl_estimate(logp: torch.Tensor, ref: float, estimator: str) -> torch.Tensor:
    """One token's estimate of KL(pi || pi_ref) from d = log pi - log pi_ref (Schulman 2020):
    k1 = d, abs = |d|, k2 = d^2 / 2, k3 = e^x - x - 1 with x = clamp(-d, -20, 20), clamped to
    [-10, 10] (verl's low_var_kl). `logp` is a float64 scalar with gradient."""
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        x = (-d).clamp(-20, 20)
        return (torch.exp(x) - x - 1).clamp(-10, 10)
    raise ValueError(f"kl_estimator {estimator!r} has no reference")


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old,
    adv,
    mask,
    token_weight=None,
    kl_penalty=None,
    *,
    loss_agg: str = "token-mean",
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    kl_cov_coef: float = 1.0,
    horizon: int | None = None,
    ref_logp=None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    is_weights=None,
) -> torch.Tensor:
    """The aggregated loss, token by token, differentiable w.r.t. `logp` (a float64 leaf).

    Per valid token, with log r = clamp(logp - old, -20, 20) and a = A_i * token_weight:

        grpo, cagrpo, clip_cov:  max(-a r, -a clip(r, 1 - eps_low, 1 + eps_high)),
                                 and for a < 0 at most -a c (dual-clip; c = clip_ratio_c)
                                 (cagrpo: token_weight = w~; clip_cov: 0 on its chosen tokens)
        kl_cov:                  -A_i r + kl_cov_coef * kl_penalty * |log r|
        + kl_coef * KL(pi || pi_ref), estimated by `kl_estimate(..., kl_estimator)`

    `is_weights` multiply each token's term (the truncated IS correction: the gradient is
    w_t times the token's; the library keeps the logged value unweighted, so compare
    gradients). Aggregation over the responses with at least one valid token: token-mean
    (/ tokens), seq-mean-token-mean (mean of per-response means), seq-mean-token-sum (mean
    of per-response sums), seq-mean-token-sum-norm (/ (responses * horizon), Dr.GRPO).
    """
    B, T = mask.shape
    per_row = []
    for i in range(B):
        row = []
        for t in range(T):
            if not mask[i, t]:
                continue
            log_r = (logp[i, t] - float(old[i, t])).clamp(-20, 20)
            r = torch.exp(log_r)
            if name == "kl_cov":
                penalty = float(kl_penalty[i, t]) if kl_penalty is not None else 0.0
                term = -float(adv[i]) * r + kl_cov_coef * penalty * log_r.abs()
            else:
                weight = 1.0 if token_weight is None else float(token_weight[i, t])
                a = float(adv[i]) * weight
                # max(-a r, -a clip(r)): r capped at 1 + eps_high (a > 0), floored at 1 - eps_low
                if a >= 0:
                    term = -a * torch.clamp(r, max=1 + clip_eps_high)
                else:
                    term = -a * torch.clamp(r, min=1 - clip_eps_low)
                    if clip_ratio_c is not None:  # min(term, -a c)
                        term = torch.clamp(term, max=-a * clip_ratio_c)
            if ref_logp is not None and kl_coef:
                term = term + kl_coef * kl_estimate(logp[i, t], float(ref_logp[i, t]), kl_estimator)
            if is_weights is not None:
                term = float(is_weights[i, t]) * term
            row.append(term)
        per_row.append(row)
    zero = torch.zeros((), dtype=torch.float64)
    tokens = sum(len(r) for r in per_row)
    seqs = sum(1 for r in per_row if r)
    total = sum((sum(r) for r in per_row if r), zero)
    if loss_agg == "token-mean":
        return total / max(tokens, 1)
    if loss_agg == "seq-mean-token-mean":
        return sum((sum(r) / len(r) for r in per_row if r), zero) / max(seqs, 1)
    if loss_agg == "seq-mean-token-sum":
        return total / max(seqs, 1)
    if loss_agg == "seq-mean-token-sum-norm":
        return total / max(seqs * (horizon or T), 1)
    raise ValueError(f"loss_agg {loss_agg!r} has no reference")
