"""pass@k and maj@k, `evaluate` on a scripted engine, the CLI's sources, and one real CLI run."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cagrpo_ray.data.types import PromptItem
from cagrpo_ray.eval import evaluate, maj_at_k, majority_answer, pass_at_k
from cagrpo_ray.eval.cli import load_prompt_source
from cagrpo_ray.eval.metrics import k_values
from cagrpo_ray.rewards import RewardResult
from cagrpo_ray.types import Completion, SamplingConfig

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

# ---------------------------------------------------------------- pass@k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_pass_at_k_matches_brute_force_enumeration(data):
    n = data.draw(st.integers(1, 12), label="n")
    c = data.draw(st.integers(0, n), label="c")
    k = data.draw(st.integers(1, n), label="k")
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


@pytest.mark.unit
def test_pass_at_k_special_cases_and_stability():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 6, 5) == 1.0  # fewer than k wrong samples
    # n = 10_000 overflows float binomials (C(10000, 5000) ~ 1e3008); the product form doesn't
    assert pass_at_k(10_000, 1, 5_000) == pytest.approx(0.5)
    assert math.isfinite(pass_at_k(10_000, 17, 4_000))
    for bad in ((5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


@pytest.mark.unit
def test_reported_ks():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(6) == [1, 2, 4, 6]


# ---------------------------------------------------------------- maj@k


@pytest.mark.unit
def test_majority_vote_and_its_tie_break():
    assert maj_at_k(["3", "4", "3"], [True, False, True]) == 1.0
    assert maj_at_k(["4", "3", "4"], [False, True, False]) == 0.0
    # a tie goes to the answer seen first
    assert majority_answer(["7", "8", "8", "7"]) == 0
    assert maj_at_k(["7", "8", "8", "7"], [False, True, True, False]) == 0.0
    # no answer does not vote, whitespace does not split votes
    assert maj_at_k([None, None, "5", "x"], [False, False, True, False]) == 1.0
    assert majority_answer([" 1 2", "9", "1  2 "]) == 0
    assert maj_at_k([None, None], [False, False]) == 0.0
    # only the first k samples vote
    assert maj_at_k(["1", "2", "2"], [True, False, False], k=1) == 1.0
    with pytest.raises(ValueError):
        maj_at_k(["1"], [True, False])


# ---------------------------------------------------------------- evaluate on a scripted engine


class ScriptedEngine:
    """Answers prompt i with `script[i]`, a list of (text, logprobs) per sample."""

    policy_version = 0

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        groups = []
        for prompt, samples in zip(prompts, self.script, strict=True):
            assert len(samples) == sampling.n
            group = []
            for text, logprobs in samples:
                finish_reason = "length" if text.endswith("...") else "stop"
                tokens = list(range(len(logprobs)))
                group.append(Completion(prompt, tokens, logprobs, text, finish_reason, 0))
            groups.append(group)
        return groups


def exact_answer_reward(responses, items):
    """Correct when the answer tag holds the item's answer (a stand-in for the verifier pool)."""
    from cagrpo_ray.rewards import extract_tagged

    results = []
    for response, item in zip(responses, items, strict=True):
        correct = extract_tagged(response) == item.answer
        results.append(RewardResult(float(correct), correct, {"task": float(correct)}, None))
    return results


def tokenizer():
    from cagrpo_ray.policies.tokenizer import char_tokenizer

    return char_tokenizer()


ITEMS = [PromptItem("q0", "1+1=", "2"), PromptItem("q1", "2+2=", "4")]
SCRIPT = [
    [  # 1 of 4 right; the majority (a wrong "3") wins
        ("<think>1+1</think><answer>2</answer>", [-1.0, -1.0]),
        ("<answer>3</answer>", [-2.0]),
        ("<answer> 3</answer>", [-2.0]),
        ("<answer>3</answer>", [-1.0]),
    ],
    [  # 1 of 4 right; no answer in two samples, so the right one wins the vote 1-1 by order
        ("<answer>4</answer>", [-0.5, -0.5, -0.5]),
        ("no answer ...", [-3.0]),
        ("<answer>5</answer>", [-1.0]),
        ("still thinking ...", [-3.0, -3.0]),
    ],
]


@pytest.mark.unit
def test_evaluate_reports_pass_maj_length_and_names_the_entropy_estimate():
    engine = ScriptedEngine(SCRIPT)
    result = evaluate(
        engine,
        tokenizer(),
        ITEMS,
        exact_answer_reward,
        samples=4,
        sampling=SamplingConfig(n=1, max_tokens=16),
        details=True,
    )
    prompts, sampling = engine.calls[0]
    assert sampling.n == 4 and sampling.max_tokens == 16
    assert prompts[0] == tokenizer().encode(
        tokenizer().apply_chat_template(
            [{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True
        ),
        add_special_tokens=False,
    )
    assert result["num_prompts"] == 2 and result["samples"] == 4
    assert result["pass@1"] == pytest.approx(1 / 4)
    assert result["pass@2"] == pytest.approx(pass_at_k(4, 1, 2)) == pytest.approx(1 / 2)
    assert result["pass@4"] == 1.0
    assert result["maj@4"] == 0.5
    assert result["mean_reward"] == result["mean_task"] == pytest.approx(2 / 8)
    assert result["mean_response_tokens"] == pytest.approx((2 + 1 + 1 + 1 + 3 + 1 + 1 + 2) / 8)
    assert result["truncated_fraction"] == pytest.approx(2 / 8)
    logprobs = [lp for group in SCRIPT for _, lps in group for lp in lps]
    assert result["mean_sampled_token_nll"] == pytest.approx(-sum(logprobs) / len(logprobs))
    assert result["verifier_errors"] == 0
    assert [r["num_correct"] for r in result["per_prompt"]] == [1, 1]
    assert [r["majority_answer"] for r in result["per_prompt"]] == ["3", "4"]
    json.dumps(result)


@pytest.mark.unit
def test_evaluate_refuses_a_short_answering_engine():
    short = [group[:3] for group in SCRIPT]

    class ShortEngine(ScriptedEngine):
        def generate(self, prompts, sampling):
            return super().generate(prompts, SamplingConfig(n=3))

    with pytest.raises(RuntimeError, match="expected 2 groups of 4"):
        evaluate(ShortEngine(short), tokenizer(), ITEMS, exact_answer_reward, 4, SamplingConfig())


@pytest.mark.unit
def test_evaluate_with_the_real_verifiers():
    from cagrpo_ray.rewards import RewardFunction

    source = load_prompt_source("reasoning_gym:chain_sum?seed=3&size=3&min_terms=2&max_terms=2")
    items = list(source.iter_from(0))
    script = [
        [
            (f"<think>add</think><answer>{item.answer}</answer>", [-0.1]),
            ("<answer>no</answer>", [-1.0]),
        ]
        for item in items
    ]
    with RewardFunction({"task": 1.0, "format": 0.0}, timeout_s=5.0, num_workers=1) as reward_fn:
        result = evaluate(
            ScriptedEngine(script), tokenizer(), items, reward_fn, 2, SamplingConfig()
        )
    assert result["pass@1"] == 0.5
    assert result["pass@2"] == 1.0
    assert result["mean_format"] == 0.5
    assert result["verifier_errors"] == 0


# ---------------------------------------------------------------- the CLI's sources


@pytest.mark.unit
def test_reasoning_gym_source_spec():
    source = load_prompt_source("reasoning_gym:chain_sum?seed=11&size=5&min_terms=2&max_terms=2")
    items = list(source.iter_from(0))
    assert len(items) == 5
    assert all(item.uid.startswith("chain_sum:eval:") for item in items)
    assert all(item.metadata["num_terms"] == 2 for item in items)
    train = load_prompt_source("reasoning_gym:chain_sum?seed=11&size=5&split=train")
    assert list(train.iter_from(0))[0].uid == "chain_sum:train:0"


@pytest.mark.unit
def test_a_source_spec_can_name_a_runs_held_out_split_and_cut_a_range_of_it():
    from cagrpo_ray.data import ReasoningGymSource

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    # what a run with data.train_size=300 and data.eval_size=24 holds out (Trainer._sources)
    run_split = ReasoningGymSource(
        "basic_arithmetic", config, 5, 24, "eval", exclude_sizes={"train": 300}
    )
    query = "&".join(f"{k}={v}" for k, v in config.items())
    spec = f"reasoning_gym:basic_arithmetic?seed=5&size=40&exclude_train=300&{query}"
    longer = list(load_prompt_source(spec).iter_from(0))
    held_out = [item.question for item in run_split.iter_from(0)]
    assert [item.question for item in longer[:24]] == held_out  # a prefix of the same split
    train = {
        item.question
        for item in ReasoningGymSource("basic_arithmetic", config, 5, 300, "train").iter_from(0)
    }
    assert not train & {item.question for item in longer}
    # without the exclusion the split differs (the small question space repeats questions)
    plain = load_prompt_source(spec.replace("&exclude_train=300", ""))
    assert [item.question for item in plain.iter_from(0)] != [item.question for item in longer]


@pytest.mark.unit
def test_file_source_spec_and_bad_specs(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"problem": "What is 1/2 + 1/2?", "answer": "1"}, {"problem": "2^3?", "answer": "8"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    items = list(load_prompt_source(str(path)).iter_from(0))
    assert [item.answer for item in items] == ["1", "8"]
    for bad in ("reasoning_gym:", "math.csv", "reasoning_gym:chain_sum?seed=x"):
        with pytest.raises(ValueError):
            load_prompt_source(bad)


# ---------------------------------------------------------------- the CLI for real


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_cli_on_a_random_init_policy(tmp_path, engine):
    from cagrpo_ray.policies.model import random_policy

    model = random_policy(tmp_path / "policy", seed=0)
    out = tmp_path / "results.json"
    command = [
        sys.executable,
        "-m",
        "cagrpo_ray.eval",
        "--model",
        str(model),
        "--data",
        "reasoning_gym:chain_sum?seed=5&size=6&min_terms=2&max_terms=2",
        "--samples",
        "4",
        "--engine",
        engine,
        "--max-tokens",
        "24",
        "--out",
        str(out),
        *(["--eager"] if engine == "vllm" else []),  # vLLM starts in half the time
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "pass@4" in finished.stdout and "mean_sampled_token_nll" in finished.stdout
    record = json.loads(out.read_text())
    metrics = record["metrics"]
    assert metrics["num_prompts"] == 6 and metrics["samples"] == 4
    assert 0.0 <= metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"] <= 1.0
    assert 0 < metrics["mean_response_tokens"] <= 24
    # a random-init policy over 265 tokens: close to uniform, -log(1/265) = 5.58 nats
    assert 4.0 < metrics["mean_sampled_token_nll"] < 6.5
    assert metrics["verifier_errors"] == 0
    assert len(record["per_prompt"]) == 6
