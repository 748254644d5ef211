"""Multi-turn episodes on the real engines (HF in the unit tier, vLLM in the integration
tier): token in, token out, checked against a forward pass of each whole episode."""

from __future__ import annotations

import random

import pytest
import torch


class EchoEnvironment:
    """A turn that ends in one of `stop` (characters of the char-level policy) is a call;
    the reply names the character. A random policy ends most turns so."""

    stop = tuple("0123456789abcdefghijklmnopqrstuvwxyz")

    def reply(self, turn_text: str):
        from cagrpo_ray.env import EnvReply

        if turn_text and turn_text[-1] in self.stop:
            return EnvReply(f"<result>{turn_text[-1] * 3}</result>", False, "ok", 0.0)
        return EnvReply("", True)


@pytest.fixture(scope="module")
def random_policy_dir(random_policies):
    return random_policies[0]  # the seed-0 policy of tests/conftest.py


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("hf", marks=pytest.mark.unit),
        pytest.param("vllm", marks=pytest.mark.integration),
    ],
)
def test_episodes_on_a_real_engine_are_the_sampled_tokens_and_the_environments(
    kind, random_policy_dir, request
):
    """Token in, token out on a real engine: every policy token of every turn carries the
    log-prob a forward pass of the whole episode gives it (so each turn was sampled from
    exactly the tokens before it, never re-tokenised), every environment segment is the
    encoding of the reply to the turn before it, and first turns are the single-turn request's
    samples."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cagrpo_ray.env import run_episodes
    from cagrpo_ray.rollout.engines import make_engine
    from cagrpo_ray.types import SamplingConfig

    if kind == "vllm":  # eager, seed 0, on the same policy (tests/conftest.py), kept open
        engine = request.getfixturevalue("shared_vllm_engine")
        assert engine.model_path == str(random_policy_dir) and engine.policy_version == 0
    else:
        engine = make_engine(kind, random_policy_dir, seed=0, max_model_len=256)
    tokenizer = AutoTokenizer.from_pretrained(random_policy_dir)
    model = AutoModelForCausalLM.from_pretrained(random_policy_dir).eval()
    env = EchoEnvironment()
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    questions = ("<|user|>12+34=<|assistant|>", "hello", "<|user|>7*8<|assistant|><think>")
    prompts = [tokenizer(q).input_ids for q in questions]
    sampling = SamplingConfig(n=4, temperature=0.8, max_tokens=80, seed=random.randrange(999))
    single = engine.generate(prompts, SamplingConfig(**{**vars(sampling), "stop": env.stop}))
    episodes = run_episodes(engine.generate, env, enc, prompts, sampling, max_turns=4)
    multi = 0
    for group, single_group in zip(episodes, single, strict=True):
        for episode, first in zip(group, single_group, strict=True):
            mine = episode.from_policy or [True] * len(episode.token_ids)
            assert episode.token_ids[: len(first.token_ids)] == first.token_ids
            # split into segments: policy turns and environment replies, in order
            segments, start = [], 0
            for t in range(1, len(mine) + 1):
                if t == len(mine) or mine[t] != mine[start]:
                    segments.append((mine[start], episode.token_ids[start:t]))
                    start = t
            for (by_policy, tokens), (_, before) in zip(segments[1:], segments, strict=False):
                if not by_policy:  # the reply to the turn before, encoded, never re-tokenised
                    want = enc(env.reply(tokenizer.decode(before)).text)
                    assert tokens == want[: len(tokens)]
            multi += episode.turns > 1
            with torch.no_grad():
                logits = model(torch.tensor([episode.prompt_token_ids + episode.token_ids]))
            p = len(episode.prompt_token_ids)
            logits = logits.logits[0, p - 1 : p - 1 + len(episode.token_ids)].float()
            forward = (logits / sampling.temperature).log_softmax(-1)
            forward = forward.gather(-1, torch.tensor(episode.token_ids)[:, None]).squeeze(-1)
            at = torch.tensor(mine)
            torch.testing.assert_close(torch.tensor(episode.logprobs)[at], forward[at],
                                       atol=1e-4, rtol=0)  # fmt: skip
            assert all(lp == 0.0 for lp, m in zip(episode.logprobs, mine, strict=True) if not m)
    assert multi >= 4, "too few episodes went past one turn to test anything"
