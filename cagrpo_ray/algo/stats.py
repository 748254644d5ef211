"""Statistics over token sets: scope sums, global top-k selection, covariance quantiles.

A *scope* is the token set S that a statistic is taken over: the valid tokens of one prompt
group (`"group"`), or of the whole batch (`"batch"`). Every statistic the losses need is a sum
of per-row values over a scope, so one primitive does it: `Scope.totals`. For `"batch"` with a
process group the sums are all-reduced, so that every data-parallel rank sees the statistics of
the full batch; prompt groups are whole on one rank, so `"group"` sums never communicate.

Token selections that must not depend on how the batch is split (Clip-Cov, KL-Cov) use
`select_top_k`, which picks the same tokens on one process or across ranks: ties are broken by
the token's position in the global batch (`RowLayout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

SCOPES = ("group", "batch")

# The paper's covariance table: thresholds of the top / bottom fraction of tokens.
COVARIANCE_TABLE_FRACTIONS = (1e-4, 1e-2, 0.2, 0.4)


def float_mask(mask: Tensor) -> Tensor:
    """A bool or 0/1 mask as float32 0/1 (a float32 mask is returned as is)."""
    return mask if mask.dtype == torch.float32 else mask.to(torch.float32)


def _world(process_group) -> int:
    return 1 if process_group is None else dist.get_world_size(process_group)


@dataclass(frozen=True)
class Scope:
    """The scope of each row: `index[b]` in [0, num_scopes), with sums shared across ranks
    when `kind == "batch"` and a process group is given."""

    kind: str
    index: Tensor  # [B] int64
    num_scopes: int
    process_group: object | None = None

    @classmethod
    def of(cls, kind: str, group_ids: Tensor | None, num_rows: int, device, process_group=None):
        if kind not in SCOPES:
            raise ValueError(f"scope {kind!r} is not one of {', '.join(SCOPES)}")
        if kind == "batch":
            index = torch.zeros(num_rows, dtype=torch.long, device=device)
            return cls("batch", index, 1, process_group)
        if group_ids is None:
            raise ValueError(
                "scope='group' needs group_ids (the prompt group of each response, shape [B]); "
                "pass them, or use scope='batch'"
            )
        if group_ids.shape != (num_rows,):
            raise ValueError(
                f"group_ids must have shape [{num_rows}], got {tuple(group_ids.shape)}"
            )
        unique, index = torch.unique(group_ids.to(device), return_inverse=True)
        return cls("group", index, int(unique.numel()), None)

    def totals(self, rows: Tensor) -> Tensor:
        """[B, k] per-row values -> [num_scopes, k] sums over each scope's rows."""
        totals = rows.new_zeros(self.num_scopes, rows.shape[1]).index_add_(0, self.index, rows)
        if self.process_group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.process_group)
        return totals

    def minima(self, rows: Tensor) -> Tensor:
        """[B] per-row values -> [num_scopes] minimum over each scope's rows."""
        lowest = rows.new_full((self.num_scopes,), float("inf"))
        lowest = lowest.scatter_reduce(0, self.index, rows, reduce="amin")
        if self.process_group is not None:
            dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.process_group)
        return lowest

    def rows(self, per_scope: Tensor) -> Tensor:
        """[num_scopes, ...] -> [B, ...]: each row gets its scope's value."""
        return per_scope[self.index]


@dataclass(frozen=True)
class RowLayout:
    """Where this rank's rows sit in the global batch: rows [offset, offset + B) of
    `total_rows`, every row padded to `width` (the widest rank's T)."""

    offset: int
    total_rows: int
    width: int

    @classmethod
    def of(cls, num_rows: int, width: int, device, process_group=None) -> RowLayout:
        if process_group is None:
            return cls(0, num_rows, width)
        mine = torch.tensor([num_rows, width], dtype=torch.long, device=device)
        every = [torch.empty_like(mine) for _ in range(_world(process_group))]
        dist.all_gather(every, mine, group=process_group)
        rows = [int(t[0]) for t in every]
        rank = dist.get_rank(process_group)
        return cls(sum(rows[:rank]), sum(rows), max(int(t[1]) for t in every))

    def global_index(self, rows: Tensor, cols: Tensor) -> Tensor:
        return (rows + self.offset) * self.width + cols


def global_count(value: float, device, process_group=None) -> float:
    """Sum of a local count over the ranks of `process_group` (the value itself without one)."""
    if process_group is None:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=process_group)
    return float(t)


def global_max(value: int, device, process_group=None) -> int:
    """Maximum of a local integer over the ranks of `process_group`."""
    if process_group is None:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=process_group)
    return int(t)


def select_top_k(
    score: Tensor, eligible: Tensor, k: int, layout: RowLayout, process_group=None
) -> Tensor:
    """The k eligible tokens with the largest score, over all ranks of `process_group`.

    Args:
        score: [B, T] float scores (finite on eligible tokens).
        eligible: [B, T] bool, the tokens that may be chosen.
        k: how many to choose over the whole batch (fewer if fewer are eligible).
        layout: this rank's rows within the global batch (`RowLayout.of`).

    Returns:
        [B, T] bool, True on this rank's chosen tokens. Ties in score go to the earlier token
        of the global batch, so the choice is the same however the rows are split over ranks.
    """
    B, T = score.shape
    chosen = torch.zeros(B, T, dtype=torch.bool, device=score.device)
    if k <= 0:
        return chosen
    flat = eligible.reshape(-1).nonzero().squeeze(1)  # local positions, ascending
    gidx = layout.global_index(flat // T, flat % T).to(torch.float64)  # exact below 2**53
    values = score.reshape(-1)[flat].to(torch.float64)
    # A stable sort keeps ascending position among equal scores: the tie-break above.
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    candidates = torch.stack([values[order], gidx[order]], dim=1)  # [<=k, 2]
    if process_group is not None:
        padded = torch.full((k, 2), float("-inf"), dtype=torch.float64, device=score.device)
        padded[:, 1] = float("inf")
        padded[: candidates.shape[0]] = candidates
        every = [torch.empty_like(padded) for _ in range(_world(process_group))]
        dist.all_gather(every, padded, group=process_group)
        merged = torch.cat(every)
        merged = merged[torch.isfinite(merged[:, 1])]
        merged = merged[torch.sort(merged[:, 1], stable=True).indices]  # by position, then
        merged = merged[torch.sort(merged[:, 0], descending=True, stable=True).indices]  # score
        candidates = merged[:k]
    start, stop = layout.offset * layout.width, (layout.offset + B) * layout.width
    mine = candidates[:, 1]
    mine = mine[(mine >= start) & (mine < stop)].to(torch.long) - start
    chosen[mine // layout.width, mine % layout.width] = True
    return chosen


def masked_quantiles(values: Tensor, mask: Tensor, qs: Sequence[float]) -> list[float]:
    """Quantiles (linear interpolation, as torch.quantile) of `values` on the mask.

    Only the needed order statistics are selected (numpy's partition, O(n)), for any number of
    tokens (torch.quantile sorts, and stops at 2**24). An empty mask gives 0.0 for every
    quantile, so that no NaN reaches the metrics.
    """
    v = values.detach()[mask.bool()].to(torch.float64).cpu().numpy()
    n = v.size
    if n == 0:
        return [0.0 for _ in qs]
    positions = [q * (n - 1) for q in qs]
    below = [int(p) for p in positions]
    above = [min(lo + 1, n - 1) for lo in below]
    ranked = np.partition(v, sorted(set(below + above)))  # those ranks now sit in place
    return [
        float(ranked[lo] + (p - lo) * (ranked[hi] - ranked[lo]))
        for p, lo, hi in zip(positions, below, above, strict=True)
    ]


def _pct(fraction: float) -> str:
    return f"{fraction * 100:g}pct"


def covariance_quantiles(
    cov: Tensor, mask: Tensor, fractions: Sequence[float] = COVARIANCE_TABLE_FRACTIONS
) -> dict[str, float]:
    """The paper's covariance table: for each fraction f, the threshold above which the top f
    of tokens' covariances lie (`pos_<f>`) and below which the bottom f lie (`neg_<f>`).

    Args:
        cov: [B, T] token covariances c = (logp - mean logp) * (A - mean A).
        mask: [B, T] valid tokens.

    Returns:
        {"pos_0.01pct": ..., "neg_0.01pct": ..., "pos_1pct": ..., ..., "neg_40pct": ...}.
    """
    qs = [1.0 - f for f in fractions] + list(fractions)
    values = masked_quantiles(cov, mask, qs)
    n = len(fractions)
    table = {}
    for i, f in enumerate(fractions):
        table[f"pos_{_pct(f)}"] = values[i]
        table[f"neg_{_pct(f)}"] = values[n + i]
    return table


def format_covariance_table(table: dict[str, float]) -> str:
    """A markdown table of `covariance_quantiles`' output, one row per fraction."""
    fractions = [key[len("pos_") :] for key in table if key.startswith("pos_")]
    lines = ["| top / bottom fraction | positive threshold | negative threshold |", "|---|---|---|"]
    for f in fractions:
        shown = f.replace("pct", "%")
        lines.append(f"| {shown} | {table['pos_' + f]:+.4g} | {table['neg_' + f]:+.4g} |")
    return "\n".join(lines)
