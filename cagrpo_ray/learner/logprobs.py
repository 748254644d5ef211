"""The policy as token log-probs: log-probs and entropies of the tokens a batch holds.

A causal LM's forward returns logits for every position, [b, w, V]: for the GPU recipes (V =
152k, 4 x 5,120 tokens per micro-batch) that is 12 GB in bf16 before the float32 softmax, and
more in the backward pass. `TokenLogprobs` runs the decoder once, then the output head and the
softmax over chunks of positions; with gradient, each chunk is recomputed in the backward pass
(activation checkpointing), so only one chunk's logits are alive at a time:

    h        = decoder(input_ids)                              [b, w, H]
    z_t      = head(h_t) / T                                   one chunk of positions at a time
    log pi   = z_t[o_{t+1}] - logsumexp(z_t)                   the next token's log-prob
    H_t      = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v     entropy (when asked for)

Values are "at the token": column t holds log p(input_ids[t] | input_ids[:t]); column 0 is 0.
The head runs on every position of a chunk (the last column's value is dropped), so a batch
that fits one chunk computes exactly what `model(...).logits` followed by a log-softmax would.
With `wanted` (the tokens whose log-probs are used: a learner's response tokens), the head runs
only on the positions that predict them, and every other column is 0: the prompt and the
padding cost the decoder's work but not the head's (as TRL's `logits_to_keep` does). On
SmolLM2-135M the head is about a fifth of a forward pass's FLOPs, and a rank's step with ~70
prompt tokens a row measured within the noise of the full head's (benchmarks/results/
bench_learner.md); the saving grows with the prompt's share of the rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from cagrpo_ray.learner.batch import position_ids
from cagrpo_ray.learner.packing import PackingCost, pack_prompts

# A chunk's float32 logits, softmax and product with z: three [positions, V] tensors.
_FLOAT32_COPIES = 3


def chunk_positions(vocab_size: int, budget_mib: float) -> int:
    """Positions per chunk so that a chunk's float32 softmax work fits `budget_mib` MiB."""
    return max(1, int(budget_mib * 2**20 // (_FLOAT32_COPIES * 4 * vocab_size)))


class TokenLogprobs(torch.nn.Module):
    """Wraps a Hugging Face causal LM (`policy`, kept as a submodule) so that its forward
    returns token log-probs and, optionally, entropies instead of logits.

    temperature: the sampling temperature the log-probs are of; budget_mib: memory for one chunk
    of float32 logits work (`chunk_positions`).
    """

    def __init__(self, policy: torch.nn.Module, temperature: float = 1.0, budget_mib: float = 1024):
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.policy = policy
        self.temperature = temperature
        self.chunk = chunk_positions(policy.config.vocab_size, budget_mib)
        self.packing_cost = PackingCost.of(policy)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        with_entropy: bool = False,
        wanted: Tensor | None = None,
        groups: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """input_ids, attention_mask: [b, w], right-padded; wanted: [b, w] bool, the tokens
        whose log-probs are computed (None: all); groups: [b] prompt group ids, with which rows
        that share a prompt run it once (`packing.pack_prompts`, where that costs less).
        Returns ([b, w] float32 log-probs at the token, [b, w] float32 entropies of the
        distribution each token was drawn from or None); both 0 in column 0 and at every
        token not wanted."""
        decoder = self.policy.get_decoder()
        b, w = input_ids.shape
        packed = None
        if groups is not None and wanted is not None and _right_padded(attention_mask):
            packed = pack_prompts(input_ids, attention_mask, wanted, groups, self.packing_cost)
        if packed is not None:
            hidden = decoder(
                input_ids=packed.input_ids,
                attention_mask=packed.additive_mask(self.policy.dtype),
                position_ids=packed.positions,
                use_cache=False,
            ).last_hidden_state
            return self._heads(hidden.reshape(-1, hidden.shape[-1]), input_ids, with_entropy,
                               wanted, packed.source)  # fmt: skip
        if _right_padded(attention_mask):
            # Under causal attention a real token never sees the padding after it, so no mask
            # is needed (the padding's own outputs are never used) and attention can take its
            # causal fast path instead of a masked one.
            attention_mask = None
            positions = None
        else:
            positions = position_ids(attention_mask)
        hidden = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=False,
        ).last_hidden_state
        return self._heads(hidden.reshape(b * w, -1), input_ids, with_entropy, wanted)

    def _heads(
        self,
        flat: Tensor,
        input_ids: Tensor,
        with_entropy: bool,
        wanted: Tensor | None,
        source: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The output head and softmax on the decoder's hidden states `flat`: [b * w, h] in
        the row layout, or (with `source`, the row layout's index into it) a packed one."""
        b, w = input_ids.shape
        # position t predicts token t + 1; the last position's target is a placeholder
        targets = F.pad(input_ids[:, 1:], (0, 1)).reshape(-1)
        keep = None
        if wanted is not None:  # the positions that predict a wanted token (at least one)
            keep = F.pad(wanted[:, 1:], (0, 1)).reshape(-1).nonzero().squeeze(-1)
            keep = keep if keep.numel() else keep.new_zeros(1)
            targets = targets[keep]
            flat = flat[keep] if source is None else flat[source[keep].clamp(min=0)]
        track = torch.is_grad_enabled() and flat.requires_grad
        logprobs, entropies = [], []
        for start in range(0, flat.shape[0], self.chunk):
            args = (flat[start : start + self.chunk], targets[start : start + self.chunk])
            if track:
                lp, ent = checkpoint(self._chunk, *args, with_entropy, use_reentrant=False)
            else:
                lp, ent = self._chunk(*args, with_entropy)
            logprobs.append(lp)
            entropies.append(ent)
        logprobs = _at_the_token(_scattered(torch.cat(logprobs), keep, b * w), b, w)
        entropy = None
        if with_entropy:
            entropy = _at_the_token(_scattered(torch.cat(entropies), keep, b * w), b, w)
        if wanted is not None:  # position 0 stands in when nothing is wanted
            logprobs = logprobs * wanted
            entropy = None if entropy is None else entropy * wanted
        return logprobs, entropy

    def _chunk(self, hidden: Tensor, targets: Tensor, with_entropy: bool):
        z = self.policy.get_output_embeddings()(hidden).to(torch.float32)
        if self.temperature != 1.0:
            z = z / self.temperature
        logz = torch.logsumexp(z, dim=-1)
        logprob = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
        if not with_entropy:
            return logprob, logprob.new_zeros(())
        return logprob, logz - (torch.softmax(z, dim=-1) * z).sum(-1)


def keep_head_gathered(module: TokenLogprobs) -> None:
    """Under ZeRO-3 (after `deepspeed.initialize`): keep the output head's weight gathered for
    the module's whole pass. ZeRO-3 gathers a module's parameters when it runs and releases
    them after; the head runs once per chunk of positions, so it would be all-gathered once a
    chunk (tests/test_learner.py counts it: as many releases as head calls). As an external
    parameter of the module it is gathered when its forward (and backward) starts
    and released when it ends."""
    import deepspeed

    head = module.policy.get_output_embeddings()
    deepspeed.zero.register_external_parameter(module, head.weight)


def _scattered(values: Tensor, keep: Tensor | None, n: int) -> Tensor:
    """The values of positions `keep` in a length-n vector of zeros (`values` when all kept)."""
    if keep is None:
        return values
    return values.new_zeros(n).index_copy(0, keep, values)


def _at_the_token(values: Tensor, b: int, w: int) -> Tensor:
    """[b * w] values of positions 0..w-1 (predicting tokens 1..w) -> [b, w] at the token."""
    return F.pad(values.view(b, w)[:, :-1], (1, 0))


def _right_padded(attention_mask: Tensor) -> bool:
    """Every row is its real tokens, then padding only: the mask never rises along a row."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
