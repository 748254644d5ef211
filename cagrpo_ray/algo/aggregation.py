"""How per-token losses become one number: the aggregation modes of `LossSpec.loss_agg`.

Every mode divides by counts of the WHOLE batch over all data-parallel ranks (`PreparedLoss`),
so a micro-batch's value is its share of the batch loss and the shares add up, whatever the
micro-batch size (verl's [legacy] path divides per micro-batch instead). With m the mask, l
the token loss, N_tokens the valid tokens, N_seqs the responses with at least one valid token
and L Dr.GRPO's constant length (the longest response allowed):

    token-mean:               sum_{i,t} m_it l_it / N_tokens
    seq-mean-token-mean:      sum_i (sum_t m_it l_it / sum_t m_it) / N_seqs
    seq-mean-token-sum:       sum_{i,t} m_it l_it / N_seqs
    seq-mean-token-sum-norm:  sum_{i,t} m_it l_it / (N_seqs * L)                  (Dr.GRPO)

token-mean weighs every token alike (DAPO); seq-mean-token-mean every response alike (the
GRPO paper); seq-mean-token-sum weighs a response by its length, like a sequence-level
REINFORCE sum (verl's mode of the same name); seq-mean-token-sum-norm is it over a constant L,
so no length bias and a scale that does not move with the batch's lengths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cagrpo_ray.algo.batch_stats import PreparedLoss

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate(values: Tensor, mask: Tensor, mode: str, prepared: PreparedLoss) -> Tensor:
    """Reduce per-token values [B, T] (mask [B, T] float 0/1) to this micro-batch's share of
    the batch loss, a scalar; the divisors are `prepared`'s whole-batch counts (see above)."""
    if mode == "token-mean":
        return torch.linalg.vecdot(values, mask).sum() / max(prepared.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = torch.linalg.vecdot(values, mask) / mask.sum(1).clamp(min=1.0)
        return per_seq.sum() / max(prepared.num_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return torch.linalg.vecdot(values, mask).sum() / max(prepared.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        total = torch.linalg.vecdot(values, mask).sum()
        return total / max(prepared.num_seqs * prepared.horizon, 1.0)
    raise ValueError(f"loss_agg {mode!r} is not one of {', '.join(LOSS_AGG_MODES)}")
