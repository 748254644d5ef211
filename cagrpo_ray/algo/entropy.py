"""Token entropies and log-probs from logits, in chunks so memory stays bounded.

For logits z over a vocabulary V (one position):

    log pi(v) = z_v - logsumexp(z)
    H         = -sum_v pi(v) log pi(v) = logsumexp(z) - sum_v softmax(z)_v z_v

A [B, T, V] float32 softmax for T = 4096 and V = 150k is 2.4 GB per sequence, so both functions
work through the B * T positions `chunk_size` at a time, upcasting one chunk to float32. With
gradient, each chunk is recomputed in the backward pass (activation checkpointing), so the
float32 softmax of only one chunk is alive at any time.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _entropy_chunk(logits: Tensor) -> Tensor:
    z = logits.to(torch.float32)
    logz = torch.logsumexp(z, dim=-1)
    return logz - (torch.softmax(z, dim=-1) * z).sum(-1)


def _logprob_chunk(logits: Tensor, targets: Tensor) -> Tensor:
    z = logits.to(torch.float32)
    picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _chunked(fn, chunk_size: int, logits: Tensor, *others: Tensor) -> Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    rest = [o.reshape(-1) for o in others]
    track = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, flat.shape[0], chunk_size):
        args = [flat[start : start + chunk_size]] + [o[start : start + chunk_size] for o in rest]
        if track:
            pieces.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            pieces.append(fn(*args))
    if not pieces:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(pieces).view(lead)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Entropy of the full next-token distribution at every position.

    Args:
        logits: [..., V] (e.g. [B, T, V]), any float dtype.
        chunk_size: positions per chunk; peak extra memory ~ 3 * chunk_size * V float32.

    Returns:
        [...] float32 entropies in nats; differentiable w.r.t. logits.
    """
    return _chunked(_entropy_chunk, chunk_size, logits)


def logprobs_from_logits(logits: Tensor, targets: Tensor, chunk_size: int = 1024) -> Tensor:
    """log pi(target) = z_target - logsumexp(z) at every position, without a full log_softmax.

    Args:
        logits: [..., V]; targets: [...] int64 token ids (the token sampled at that position).
        chunk_size: positions per chunk.

    Returns:
        [...] float32 log-probs; differentiable w.r.t. logits.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape {tuple(logits.shape[:-1])} (logits without the vocab "
            f"dimension), got {tuple(targets.shape)}"
        )
    return _chunked(_logprob_chunk, chunk_size, logits, targets)
