"""Shared prompts: a prompt group's prompt runs once, its responses packed after it.

The learner batch holds one row per response, so a group of n responses repeats its prompt n
times and the decoder runs forward and backward over every copy. On the built-in policy's
task a prompt is ~74 tokens and a response ~18: four fifths of the learner's tokens were
prompt copies. Packed, the rows of a group that share their prompt become one sequence

    prompt (p tokens) | response 1 | response 2 | ... | response n
    positions 0..p-1  | p, p+1, .. | p, p+1, .. | ... | p, p+1, ..

with an attention mask under which each response attends to the prompt and to its own earlier
tokens only. Every token then sees the context it has in its own row, at the same positions,
so its hidden state, log-prob and entropy are the padded row's up to float rounding, and the
parameters' gradient is the same sum: the prompt's activations take the n responses' gradients
once instead of n copies taking one each.

What it costs: attention under an arbitrary mask is dense (every query against every key of
the packed sequence, L^2 pairs, where a causal padded row of width w has ~w^2/2), so with long
responses the wasted pairs can cost more than the prompt copies saved. `PackingCost` compares
the two layouts of a micro-batch by the decoder's multiply-adds and `TokenLogprobs` packs only
where packing is cheaper. A response's "prompt" is every token before its first wanted one
(`wanted`), which also covers multi-turn rows (tool results inside the response stay in the
response); rows of a group whose prompts differ are packed separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Dense masked attention is slower per pair than the causal kernels a padded row runs (no
# blocks skipped, a mask read per pair); the pair cost is weighted by this much against the
# causal path's.
MASKED_PAIR_WEIGHT = 2.0
# No packed micro-batch with a mask of more entries than this (G x L x L).
MAX_MASK_ENTRIES = 64 * 2**20


@dataclass(frozen=True)
class PackingCost:
    """A decoder's multiply-adds per token (one layer's weights) and per attention pair (a
    query against a key: q.k and the weighted value, over every head)."""

    per_token: float
    per_pair: float

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackingCost:
        """From a Hugging Face causal LM: its decoder's parameters per layer (embeddings and
        final norm left out) and its attention heads' widths."""
        config = model.config
        layers = int(getattr(config, "num_hidden_layers", 1) or 1)
        decoder = model.get_decoder()
        embeddings = {id(p) for p in model.get_input_embeddings().parameters()}
        weights = sum(_numel(p) for p in decoder.parameters() if id(p) not in embeddings)
        hidden = int(config.hidden_size)
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        return cls(per_token=weights / layers, per_pair=2.0 * heads * head_dim)

    def padded(self, lengths: Tensor) -> float:
        """One right-padded row per response, trimmed to the longest (causal attention)."""
        width = float(lengths.max())
        rows = lengths.numel()
        return rows * width * self.per_token + rows * width * width / 2 * self.per_pair

    def packed(self, groups: int, width: int) -> float:
        return groups * width * (self.per_token + width * self.per_pair * MASKED_PAIR_WEIGHT)


@dataclass(frozen=True)
class Packed:
    """A micro-batch in the packed layout.

    input_ids, positions: [G, L]; mask: [G, 1, L, L] bool, True where a query may attend to a
    key; source: [b * w] long, for each token of the row layout (row-major) its index in the
    flattened [G * L] packed layout, -1 for padding and for rows that are not packed (no
    token wanted)."""

    input_ids: Tensor
    positions: Tensor
    mask: Tensor
    source: Tensor

    def additive_mask(self, dtype: torch.dtype) -> Tensor:
        """The mask as the additive float mask attention implementations take (0 or min)."""
        zero = torch.zeros((), dtype=dtype, device=self.mask.device)
        return torch.where(self.mask, zero, torch.finfo(dtype).min)


def pack_prompts(
    input_ids: Tensor,
    attention_mask: Tensor,
    wanted: Tensor,
    groups: Tensor,
    cost: PackingCost | None = None,
) -> Packed | None:
    """The packed layout of a right-padded micro-batch ([b, w] tensors; `groups` [b] prompt
    group ids), or None where packing shares no prompt, would cost more than the padded
    layout (`cost`), or would need a mask over MAX_MASK_ENTRIES."""
    lengths = attention_mask.long().sum(1).tolist()
    b, w = input_ids.shape
    any_wanted = wanted.any(1).tolist()
    first = torch.where(wanted.any(1), wanted.long().argmax(1), w).clamp(min=1).tolist()
    ids = input_ids.tolist() if input_ids.device.type == "cpu" else input_ids.cpu().tolist()
    units: list[tuple[int, list[int]]] = []  # (prompt length, rows), first row's prompt
    found: dict[tuple[int, int, tuple[int, ...]], int] = {}
    for row, group in enumerate(groups.tolist()):
        if not any_wanted[row]:
            continue
        p = first[row]
        key = (group, p, tuple(ids[row][:p]))
        if key in found:
            units[found[key]][1].append(row)
        else:
            found[key] = len(units)
            units.append((p, [row]))
    if not units or len(units) == sum(any_wanted):
        return None  # no prompt is shared
    sizes = [p + sum(lengths[r] - p for r in rows) for p, rows in units]
    width, count = max(sizes), len(units)
    if count * width * width > MAX_MASK_ENTRIES:
        return None
    if cost is not None:
        kept = torch.tensor([lengths[r] for r, s in enumerate(any_wanted) if s])
        if cost.packed(count, width) >= cost.padded(kept):
            return None

    packed_ids = torch.zeros(count, width, dtype=input_ids.dtype)
    positions = torch.zeros(count, width, dtype=torch.long)
    segment = torch.full((count, width), -1, dtype=torch.long)
    source = torch.full((b, w), -1, dtype=torch.long)
    for g, (p, rows) in enumerate(units):
        base = g * width
        packed_ids[g, :p] = input_ids[rows[0], :p].cpu()
        positions[g, :p] = torch.arange(p)
        segment[g, :p] = 0
        at = p
        for k, row in enumerate(rows, 1):
            n = lengths[row] - p
            packed_ids[g, at : at + n] = input_ids[row, p : lengths[row]].cpu()
            positions[g, at : at + n] = torch.arange(p, p + n)
            segment[g, at : at + n] = k
            source[row, :p] = base + torch.arange(p)
            source[row, p : lengths[row]] = base + at + torch.arange(n)
            at += n
    columns = torch.arange(width)
    causal = columns[None, :] <= columns[:, None]  # [query, key]
    keys, queries = segment[:, None, :], segment[:, :, None]
    mask = causal & (keys >= 0) & ((keys == 0) | (keys == queries))
    mask |= torch.eye(width, dtype=torch.bool)  # a padding query attends to itself only
    device = input_ids.device
    return Packed(
        input_ids=packed_ids.to(device),
        positions=positions.to(device),
        mask=mask.unsqueeze(1).to(device),
        source=source.reshape(-1).to(device),
    )


def _numel(p: torch.nn.Parameter) -> int:
    """A parameter's full size, also once ZeRO-3 has partitioned it."""
    return int(getattr(p, "ds_numel", 0) or p.numel())
