"""vLLM and HF engines on the small random policy: shapes, finish reasons, behavior log-probs.

Measured on the 2-core CPU machine (float32 policy, both engines): greedy tokens are equal, and
the behavior log-probs of either engine differ from a float32 HF forward recomputation
(`log_softmax(logits / T)`) by at most about 1e-6 (9.5e-7 at T = 1 and T = 0.7); the tolerance
below, 1e-4, leaves room for other CPUs' kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.rollout.engines import make_engine
from cagrpo_ray.types import SamplingConfig

LOGPROB_ATOL = 1e-4
QUESTIONS = ["<|user|>12+34=<|assistant|>", "hello", "<|user|>7*8<|assistant|><think>", "a b c"]


@pytest.fixture(scope="module")
def policy_dirs(random_policies):
    return random_policies  # tests/conftest.py: seeds 0 and 1


@pytest.fixture(scope="module")
def prompts(policy_dirs):
    tokenizer = AutoTokenizer.from_pretrained(policy_dirs[0])
    return [tokenizer(q).input_ids for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_engine(policy_dirs):
    return make_engine("hf", policy_dirs[0], seed=0, max_model_len=256)


@pytest.fixture()
def vllm_engine(shared_vllm_engine):
    """Eager, seed 0, on `policy_dirs[0]` at version 0 (tests/conftest.py); tests leave it so."""
    return shared_vllm_engine


@pytest.fixture(
    params=[
        pytest.param("hf", marks=pytest.mark.unit),  # the reference engine: fast, in-process
        pytest.param("vllm", marks=pytest.mark.integration),
    ]
)
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


def hf_forward_logprobs(model, completion, temperature: float) -> torch.Tensor:
    """log p(token_t | prefix) from one full forward pass: the learner's recomputation."""
    prompt, tokens = completion.prompt_token_ids, completion.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    if temperature > 0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.unit
def test_sampling_config_rejects_bad_values():
    for bad in ({"n": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"max_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingConfig(**bad)
    assert SamplingConfig(temperature=0).greedy


@pytest.mark.unit
def test_make_engine_names_the_kinds(policy_dirs):
    with pytest.raises(ValueError, match="'vllm' or 'hf'"):
        make_engine("sglang", policy_dirs[0])


@pytest.mark.unit
def test_hf_engine_rejects_prompt_without_room(hf_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        hf_engine.generate([[5] * 256], SamplingConfig())


def test_completions_have_aligned_logprobs_and_finish_reasons(engine, prompts):
    sampling = SamplingConfig(n=8, temperature=1.0, max_tokens=48, seed=3)
    groups = engine.generate(prompts, sampling)
    tokenizer = AutoTokenizer.from_pretrained(engine_model_dir(engine))
    eos = tokenizer.eos_token_id
    assert len(groups) == len(prompts)
    reasons = set()
    for prompt, group in zip(prompts, groups, strict=True):
        assert len(group) == sampling.n
        for c in group:
            assert c.prompt_token_ids == prompt
            assert 1 <= len(c.token_ids) <= sampling.max_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
            assert c.policy_version == engine.policy_version
            reasons.add(c.finish_reason)
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
                shown = c.token_ids[:-1]
            else:
                assert c.finish_reason == "length" and eos not in c.token_ids
                assert len(c.token_ids) == sampling.max_tokens
                shown = c.token_ids
            assert c.text == tokenizer.decode(shown, skip_special_tokens=False)
    assert reasons == {"stop", "length"}, "the seeded batch should hold both finish reasons"


def engine_model_dir(engine) -> str:
    return engine.model_path


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behavior_logprobs_match_hf_forward(engine, prompts, policy_dirs, temperature):
    model = AutoModelForCausalLM.from_pretrained(policy_dirs[0], dtype=torch.float32)
    n = 1 if temperature == 0 else 4
    sampling = SamplingConfig(n=n, temperature=temperature, max_tokens=24, seed=5)
    groups = engine.generate(prompts, sampling)
    worst = max(
        (hf_forward_logprobs(model, c, temperature) - torch.tensor(c.logprobs)).abs().max().item()
        for group in groups
        for c in group
    )
    assert worst <= LOGPROB_ATOL, f"max |behavior - recomputed| log-prob = {worst:.3g}"


@pytest.mark.integration
def test_vllm_and_hf_greedy_agree(vllm_engine, hf_engine, prompts):
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=32)
    pairs = zip(
        vllm_engine.generate(prompts, greedy), hf_engine.generate(prompts, greedy), strict=True
    )
    for v, h in pairs:
        assert v[0].token_ids == h[0].token_ids
        assert v[0].text == h[0].text
        assert v[0].finish_reason == h[0].finish_reason
        difference = torch.tensor(v[0].logprobs) - torch.tensor(h[0].logprobs)
        assert difference.abs().max().item() <= LOGPROB_ATOL


def test_seeded_sampling_repeats_and_differs_per_prompt(engine, prompts):
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=16, seed=11)
    twice = [prompts[0], prompts[0]]
    first = engine.generate(twice, sampling)
    again = engine.generate(twice, sampling)
    tokens = [[c.token_ids for c in group] for group in first]
    assert tokens == [[c.token_ids for c in group] for group in again]
    assert tokens[0] != tokens[1], "the same prompt twice in a batch must get its own samples"
    assert tokens[0][0] != tokens[0][1], "the n samples of a prompt must differ"


def test_load_weights_changes_the_policy_and_version(engine, prompts, policy_dirs):
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=24)
    new = AutoModelForCausalLM.from_pretrained(policy_dirs[1], dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(policy_dirs[0], dtype=torch.float32)
    expected = make_engine("hf", policy_dirs[1], max_model_len=256).generate(prompts, greedy)
    before = engine.generate(prompts, greedy)
    try:
        engine.load_weights(new.named_parameters(), version=7)
        after = engine.generate(prompts, greedy)
    finally:
        engine.load_weights(old.named_parameters(), version=0)
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    assert [g[0].token_ids for g in after] == [g[0].token_ids for g in expected]
    assert {g[0].policy_version for g in after} == {7}
    restored = engine.generate(prompts, greedy)
    assert [g[0].token_ids for g in restored] == [g[0].token_ids for g in before]


def test_stop_strings_end_a_sample_where_they_appear(engine, prompts):
    """A multi-turn episode's turn ends at a tool call's closing string (`cagrpo_ray/env`):
    the sample ends with the token that completes it, which stays in the sample."""
    stop = ("1", "2", "3")  # characters of the char-level policy, in no special token
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=48, seed=11, stop=stop)
    by_stop = 0
    for group in engine.generate(prompts, sampling):
        for c in group:
            assert len(c.logprobs) == len(c.token_ids)
            if c.finish_reason == "stop" and c.text and c.text[-1] in stop:
                by_stop += 1
                assert not any(s in c.text[:-1] for s in stop), c.text
            else:  # the end of sequence, or the budget, before any stop string
                assert not any(s in c.text for s in stop), (c.finish_reason, c.text)
    assert by_stop > 0
