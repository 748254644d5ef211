"""The learner's forward passes: micro-batches of a rank's rows and the log-probs of each.

`ForwardPasses` owns how a rank's batch is cut into micro-batches (length-sorted, whole prompt
groups where prompts are shared) and runs the policy (a `TokenLogprobs`, inside the DeepSpeed
engine) and the frozen reference policy over them: with gradient one micro-batch at a time
(`logprobs`), or under no_grad over the whole batch (`no_grad`). Its `proximal` pass is the
first part of a learner step. Every rank runs as many micro-batches (ZeRO's collectives run
inside forward and backward), so a rank with fewer rows pads with empty ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cagrpo_ray.learner.distributed import all_reduce_


@dataclass(frozen=True)
class ProximalPass:
    """The proximal (old) policy's view of a rank's batch, each [B, T], 0 off the responses.

    logprobs, entropy: the current weights' log-probs at the token and token entropies
    (detached); ref_logprobs: the reference policy's (None without one); fused: when the
    training pass doubled as this one, its micro-batches and their (log-probs, entropies)
    with gradient, for the one update to backpropagate through (None otherwise).
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor | None
    fused: tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]] | None


class ForwardPasses:
    """Micro-batching and log-prob passes of one learner rank.

    policy: the DeepSpeed engine around the `TokenLogprobs` being trained; reference: the frozen
    reference policy (a `TokenLogprobs` or its ZeRO-3 engine), or None; micro_batch_size:
    responses per pass; share_prompts: micro-batches keep prompt groups whole, so that a
    group's prompt runs once (`logprobs.TokenLogprobs`); length_buckets: the parts a fused
    proximal pass runs in.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        reference: torch.nn.Module | None,
        micro_batch_size: int,
        share_prompts: bool,
        length_buckets: int,
        device: torch.device,
    ) -> None:
        self.policy, self.reference = policy, reference
        self.micro_batch_size = micro_batch_size
        self.share_prompts = share_prompts
        self.length_buckets = length_buckets
        self.device = device

    def micro_batches(
        self, lengths: torch.Tensor, count: int | None = None, groups: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Row indices of each micro-batch (`count` of them, or as many as
        `micro_batch_size` needs), rows sorted by length so that a micro-batch's padding,
        which its forward pass trims, is small. With `groups` (the rows' prompt group ids)
        and `share_prompts`, a group's rows stay together (groups sorted by their longest
        row), so that a micro-batch runs each prompt once. The same number on every rank
        (ZeRO's collectives run inside forward and backward, so every rank runs as many)."""
        rows = lengths.numel()
        wanted = count if count is not None else math.ceil(rows / self.micro_batch_size)
        wanted = torch.tensor([wanted], device=self.device)
        wanted = int(all_reduce_(wanted, "max").item())
        lengths = lengths.cpu()
        if groups is not None and self.share_prompts:
            groups = groups.cpu()
            _, group_index = torch.unique_consecutive(groups, return_inverse=True)
            longest = torch.zeros(int(group_index.max()) + 1, dtype=lengths.dtype)
            longest = longest.scatter_reduce(0, group_index, lengths, "amax")
            # groups by their longest row (ascending), then by length within a group
            key = (longest[group_index] * (rows + 1) + group_index) * (int(lengths.max()) + 1)
            order = torch.argsort(key + lengths, stable=True)
        else:
            order = torch.argsort(lengths, stable=True)
        return list(order.tensor_split(wanted))

    def groups(self, batch, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows' prompt group ids where prompts are shared (`share_prompts`), else None."""
        if not self.share_prompts:
            return None
        return batch["group_ids"] if rows is None else batch["group_ids"][rows]

    def batch_micro_batches(self, batch, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`micro_batches` of the batch's rows `rows` (all rows: None), indices into them."""
        mask = batch["attention_mask"] if rows is None else batch["attention_mask"][rows]
        return self.micro_batches(mask.sum(1), groups=self.groups(batch, rows))

    def logprobs(self, model, batch, rows: torch.Tensor, with_entropy: bool):
        """[r, W] log-probs at the token (and entropies, or None) of the micro-batch `rows`
        under `model` (`self.policy` or `self.reference`), W the batch's width; 0 outside the
        rows' response tokens. With gradient where gradient is enabled."""
        attention_mask = batch["attention_mask"][rows]
        # Cut the padding columns that no row of this micro-batch uses.
        used = int(attention_mask.any(0).nonzero().max().item()) + 1
        width = attention_mask.shape[1]
        logprobs, entropy = model(
            input_ids=batch["input_ids"][rows, :used],
            attention_mask=attention_mask[:, :used],
            with_entropy=with_entropy,
            wanted=batch["response_mask"][rows, :used],  # the head on response tokens only
            groups=self.groups(batch, rows),
        )
        logprobs = F.pad(logprobs, (0, width - used))
        return logprobs, None if entropy is None else F.pad(entropy, (0, width - used))

    @torch.no_grad()
    def no_grad(
        self,
        batch,
        micro: list[torch.Tensor],
        *,
        policy: bool = True,
        entropy: bool = False,
        reference: bool = False,
    ):
        """(policy log-probs, token entropies, reference log-probs), each [B, T] or None,
        micro-batch by micro-batch under no_grad: the policy's log-probs where `policy`, with
        entropies where `entropy` too, and the reference's where `reference` and there is a
        reference policy."""
        shape_of = batch["behavior_logprobs"]
        logprobs = torch.zeros_like(shape_of) if policy else None
        entropies = torch.zeros_like(shape_of) if entropy else None
        ref = torch.zeros_like(shape_of) if reference and self.reference is not None else None
        for rows in micro:
            rows = rows if rows.numel() else torch.zeros(1, dtype=torch.long)
            if policy:
                values, token_entropy = self.logprobs(self.policy, batch, rows, entropy)
                logprobs[rows] = values
                if entropy:
                    entropies[rows] = token_entropy
            if ref is not None:
                ref[rows] = self.logprobs(self.reference, batch, rows, False)[0]
        return logprobs, entropies, ref

    def proximal(self, batch, single_update: bool) -> ProximalPass:
        """The proximal pass: log-probs and entropies under the current weights (the ratio's
        denominator, and what the loss's batch statistics are taken on) and the reference's.

        When the step is one update (`single_update`) and the batch fits one micro-batch, the
        training forward pass is the proximal one (detached), as TRL does when it trains
        on-policy, so no second forward is needed. It then runs in `length_buckets`
        length-sorted parts (all kept for the backward pass), so that short rows are not
        padded to the longest."""
        lengths = batch["attention_mask"].sum(1)
        micro = self.micro_batches(lengths, groups=self.groups(batch))
        if not (len(micro) == 1 and single_update):
            logprobs, entropy, ref = self.no_grad(batch, micro, entropy=True, reference=True)
            return ProximalPass(logprobs, entropy, ref, None)
        micro = self.micro_batches(lengths, count=self.length_buckets, groups=self.groups(batch))
        outputs = [self.logprobs(self.policy, batch, rows, True) for rows in micro]
        logprobs = torch.zeros_like(batch["behavior_logprobs"])
        entropy = torch.zeros_like(logprobs)
        for rows, (values, token_entropy) in zip(micro, outputs, strict=True):
            logprobs[rows], entropy[rows] = values.detach(), token_entropy.detach()
        ref = self.no_grad(batch, micro, policy=False, reference=True)[2]
        return ProximalPass(logprobs, entropy, ref, (micro, outputs))
