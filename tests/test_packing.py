"""Shared prompts (learner/packing.py): a group's prompt run once with its responses packed
after it gives every wanted token the log-prob, entropy and parameter gradient of its own
padded row (float64, fresh random batches), and the cost model packs only where it pays."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cagrpo_ray.learner.logprobs import TokenLogprobs
from cagrpo_ray.learner.packing import PackingCost, pack_prompts
from cagrpo_ray.policies.model import random_policy

pytestmark = pytest.mark.unit
VOCAB = 29
ATOL = 1e-5  # float32 parts (RMSNorm, the log-prob head); a wrong context gives ~1e-1


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = random_policy(tmp_path_factory.mktemp("p"), seed=2, hidden_size=64, num_layers=2,
                         num_heads=2, intermediate_size=64)  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(path).double().train()


def grouped_batch(seed: int, groups: int = 4, size: int = 3):
    """Right-padded rows in prompt groups: a group's rows share a random prompt (2-7 tokens),
    each response 1-9 tokens, a few with unwanted tokens inside (a tool's result), one group
    whose rows' prompts differ, one row with nothing wanted."""
    g = torch.Generator().manual_seed(seed)
    rows, prompts, responses = [], [], []
    for group in range(groups):
        prompt = torch.randint(
            3, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g
        )
        for member in range(size):
            if group == 1 and member > 0:  # this group's prompts differ from its first row's
                prompt = torch.randint(3, VOCAB, (len(prompt) + member % 2,), generator=g)
            n = int(torch.randint(1, 10, (1,), generator=g))
            rows.append(group)
            prompts.append(prompt)
            responses.append(torch.randint(3, VOCAB, (n,), generator=g))
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    b = len(rows)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    wanted = torch.zeros(b, width, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, : len(p) + len(r)] = torch.cat([p, r])
        attention[i, : len(p) + len(r)] = 1
        wanted[i, len(p) : len(p) + len(r)] = True
        if len(r) >= 5 and i % 2:  # a tool's result inside the response: context, not wanted
            wanted[i, len(p) + 2 : len(p) + 4] = False
    wanted[b - 1] = False  # a row with nothing wanted
    return input_ids, attention, wanted, torch.tensor(rows)


def reference(policy, input_ids, attention, wanted, temperature):
    """Each row alone, unpadded, from the full logits: log-probs and entropies at the token."""
    logp, entropy = (
        torch.zeros(input_ids.shape, dtype=torch.float64),
        torch.zeros(input_ids.shape, dtype=torch.float64),
    )
    for i in range(input_ids.shape[0]):
        n = int(attention[i].sum())
        logits = policy(input_ids=input_ids[i : i + 1, :n]).logits.double()[0, :-1] / temperature
        all_logp = torch.log_softmax(logits, -1)
        logp[i, 1:n] = all_logp.gather(-1, input_ids[i, 1:n, None]).squeeze(-1)
        entropy[i, 1:n] = -(all_logp.exp() * all_logp).sum(-1)
    return logp * wanted, entropy * wanted


def gradients(policy, logp, entropy, weights):
    policy.zero_grad()
    ((logp + 0.1 * entropy) * weights).sum().backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


@pytest.fixture(params=[False, True], ids=["plain", "checkpointed"])
def checkpointing(policy, request):
    """The decoder's layers run plainly, or recomputed in the backward pass (as the learner
    runs SmolLM2 and the GPU recipes: the packed mask must reach the recomputed layers)."""
    if request.param:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    yield request.param
    policy.gradient_checkpointing_disable()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_prompts_give_each_rows_values_and_gradients(policy, checkpointing, seed):
    """Against each row run alone from its full logits in float64, and against the padded row
    layout. The model's weights are float64, but its RMSNorm and the log-prob head compute in
    float32, which bounds the agreement (ATOL)."""
    input_ids, attention, wanted, groups = grouped_batch(seed + 10 * checkpointing)
    packed = pack_prompts(input_ids, attention, wanted, groups)  # no cost model: always packs
    assert packed is not None
    # fewer sequences than rows, each wanted row's tokens where `source` says
    assert packed.input_ids.shape[0] < input_ids.shape[0]
    real = (attention.bool() & wanted.any(1, keepdim=True)).reshape(-1)
    assert torch.all(packed.source[real] >= 0) and torch.all(packed.source[~real] == -1)
    assert torch.equal(
        packed.input_ids.reshape(-1)[packed.source[real]], input_ids.reshape(-1)[real]
    )

    shared = TokenLogprobs(policy, 0.7)
    shared.packing_cost = None  # pack whatever the cost
    shared.chunk = 5
    weights = torch.rand(
        input_ids.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    results = {
        "reference": reference(policy, input_ids, attention, wanted, 0.7),
        "rows": TokenLogprobs(policy, 0.7)(input_ids, attention, with_entropy=True, wanted=wanted),
        "packed": shared(input_ids, attention, with_entropy=True, wanted=wanted, groups=groups),
    }
    grads = {name: gradients(policy, *values, weights) for name, values in results.items()}
    logp, entropy = results["packed"]
    assert torch.all(logp[~wanted] == 0) and torch.all(entropy[~wanted] == 0)
    for other in ("reference", "rows"):
        torch.testing.assert_close(logp.double(), results[other][0].double(), rtol=0, atol=ATOL)
        torch.testing.assert_close(entropy.double(), results[other][1].double(), rtol=0, atol=ATOL)
        for name, want in grads[other].items():
            scale = want.abs().max().item()
            torch.testing.assert_close(
                grads["packed"][name],
                want,
                rtol=0,
                atol=ATOL * scale,
                msg=lambda m, n=name, o=other: f"{n} vs {o}: {m}",
            )


def test_nothing_shared_or_nothing_wanted_is_not_packed():
    input_ids, attention, wanted, groups = grouped_batch(5)
    assert pack_prompts(input_ids, attention, wanted, torch.arange(len(groups))) is None
    assert pack_prompts(input_ids, attention, torch.zeros_like(wanted), groups) is None


def lm_batch(groups: int, size: int, prompt: int, response: int):
    rows = groups * size
    width = prompt + response
    input_ids = torch.randint(3, VOCAB, (rows, width))
    for g in range(groups):  # one prompt per group
        input_ids[g * size : (g + 1) * size, :prompt] = input_ids[g * size, :prompt]
    attention = torch.ones(rows, width, dtype=torch.long)
    wanted = torch.zeros(rows, width, dtype=torch.bool)
    wanted[:, prompt:] = True
    return input_ids, attention, wanted, torch.arange(groups).repeat_interleave(size)


def test_the_cost_model_packs_short_responses_after_long_prompts_only():
    """SmolLM2-135M's shapes (576 wide, 9 heads of 64, ~3.5M weights a layer): 2 groups of 8
    with a 70-token prompt. Responses of 18 tokens: the prompt copies are most of the tokens,
    packing pays. Responses of 200: the packed sequence's dense attention (1,670^2 pairs)
    costs more than the 7 prompt copies it saves, the rows stay padded."""
    cost = PackingCost(per_token=3.54e6, per_pair=2 * 9 * 64)
    assert pack_prompts(*lm_batch(2, 8, 70, 18), cost=cost) is not None
    assert pack_prompts(*lm_batch(2, 8, 70, 200), cost=cost) is None


def test_the_cost_of_a_policy_counts_its_layers_weights(policy):
    cost = PackingCost.of(policy)
    layer = policy.get_decoder().layers[0]
    assert cost.per_token == sum(p.numel() for p in layer.parameters()) + (
        sum(p.numel() for p in policy.get_decoder().norm.parameters()) / 2
    )
    assert cost.per_pair == 2 * 64
