"""TokenLogprobs: log-probs and entropies from chunks of positions equal those of the full
logits (float64 reference), with the same gradients, at any chunk size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cagrpo_ray.learner.logprobs import TokenLogprobs, chunk_positions
from cagrpo_ray.policies.model import random_policy

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = random_policy(tmp_path_factory.mktemp("p"), seed=1, hidden_size=32, num_layers=2,
                         num_heads=1, intermediate_size=64)  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(path).train()


def batch(seed: int, rows: int = 5, width: int = 13, vocab: int = 17):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    return torch.randint(3, vocab, (rows, width), generator=g) * attention, attention


def reference(policy, input_ids, attention, temperature):
    """log p(token t | tokens < t) and the entropy at t, from the full logits in float64."""
    from cagrpo_ray.learner.batch import position_ids

    logits = policy(input_ids=input_ids, attention_mask=attention,
                    position_ids=position_ids(attention)).logits.double()  # fmt: skip
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    pad = torch.nn.functional.pad
    return pad(picked, (1, 0)), pad(entropy, (1, 0))


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunks_give_the_full_logits_values_and_gradients(policy, chunk, temperature):
    input_ids, attention = batch(seed=chunk)
    forward = TokenLogprobs(policy, temperature)
    forward.chunk = chunk
    logprobs, entropy = forward(input_ids, attention, with_entropy=True)
    want_logp, want_entropy = reference(policy, input_ids, attention, temperature)
    valid = attention.bool() & (torch.arange(attention.shape[1]) > 0)
    torch.testing.assert_close(logprobs[valid].double(), want_logp[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[valid].double(), want_entropy[valid], rtol=1e-5, atol=1e-5)
    assert torch.all(logprobs[:, 0] == 0)

    weights = torch.rand(logprobs.shape, generator=torch.Generator().manual_seed(3))
    policy.zero_grad()
    (logprobs * weights * valid).sum().backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    (want_logp * weights.double() * valid).sum().backward()
    for name, param in policy.named_parameters():
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(
            got[name], param.grad, rtol=1e-3, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_chunk_size_follows_the_memory_budget():
    assert chunk_positions(vocab_size=151_936, budget_mib=1024) == 588
    assert chunk_positions(vocab_size=17, budget_mib=1024) > 5_000_000
    assert chunk_positions(vocab_size=10**9, budget_mib=1) == 1


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_wanted_tokens_only_give_the_same_values_and_gradients(policy, chunk):
    """With `wanted` (a learner's response tokens) the head runs only where they are predicted:
    the values there and the gradients of any loss over them are the full computation's, and
    every other column is 0; a micro-batch with nothing wanted still gives a graph."""
    input_ids, attention = batch(seed=10 + chunk)
    g = torch.Generator().manual_seed(chunk)
    starts = torch.randint(1, 4, (input_ids.shape[0],), generator=g)  # prompts of 1-3 tokens
    wanted = attention.bool() & (torch.arange(attention.shape[1]) >= starts[:, None])
    forward = TokenLogprobs(policy, 0.7)
    forward.chunk = chunk
    logprobs, entropy = forward(input_ids, attention, with_entropy=True, wanted=wanted)
    want_logp, want_entropy = reference(policy, input_ids, attention, 0.7)
    torch.testing.assert_close(logprobs[wanted].double(), want_logp[wanted], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[wanted].double(), want_entropy[wanted], rtol=1e-5, atol=1e-5)
    assert torch.all(logprobs[~wanted] == 0) and torch.all(entropy[~wanted] == 0)

    weights = torch.rand(logprobs.shape, generator=g)
    policy.zero_grad()
    ((logprobs + 0.1 * entropy) * weights * wanted).sum().backward()
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    ((want_logp + 0.1 * want_entropy) * weights.double() * wanted).sum().backward()
    for name, param in policy.named_parameters():
        scale = param.grad.abs().max().item()
        torch.testing.assert_close(
            got[name], param.grad, rtol=1e-3, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )

    nothing = torch.zeros_like(wanted)
    logprobs, _ = forward(input_ids, attention, wanted=nothing)
    assert logprobs.requires_grad and torch.all(logprobs == 0)
