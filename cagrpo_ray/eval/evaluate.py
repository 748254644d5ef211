"""Evaluate a policy on held-out prompts: sample with any engine, score with the verifiers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

from cagrpo_ray.eval.metrics import k_values, maj_at_k, majority_answer, pass_at_k
from cagrpo_ray.rewards.extract import extract_final_answer
from cagrpo_ray.types import Completion


def evaluate(
    engine,
    tokenizer,
    items: Sequence,
    reward_fn: Callable[[list[str], list], list],
    samples: int,
    sampling,
    instruction: str | None = None,
    *,
    details: bool = False,
    extract_answer: Callable[[str], str | None] = extract_final_answer,
    multi_turn: bool = False,
) -> dict[str, Any]:
    """Sample `samples` responses per item and report accuracy, length and entropy.

    Args:
        engine: anything with `generate(prompt_token_ids, sampling) -> list[list[Completion]]`
            (a `cagrpo_ray.rollout` engine or the trainer's generator pool).
        tokenizer: the policy's tokenizer; prompts are `format_prompt(tokenizer, question,
            instruction)`.
        items: `PromptItem`s.
        reward_fn: a `RewardFunction` (or a callable with its signature); `correct` of its
            results is the accuracy verdict.
        samples: responses per prompt, n; `sampling.n` is replaced by it.
        sampling: the `SamplingConfig` to sample with.
        instruction: the instruction before each question (None: none).
        details: also return `per_prompt`, one record per item.
        extract_answer: a response's final answer for the majority vote (by default the answer
            tag or box; `answer_extractor(weights)` gives the one the task verifier reads).
        multi_turn: the engine plays multi-turn episodes (`cagrpo_ray/env`): report tool use.

    Returns a flat dict of numbers:
        `pass@1` (mean accuracy over all samples), `pass@k` for k in 1, 2, 4, ..., n (the
        unbiased estimator averaged over prompts), `maj@n` (majority vote over extracted
        answers, see `cagrpo_ray.eval.metrics.maj_at_k`), `mean_reward`, `mean_<verifier>`
        per reward component, `mean_response_tokens`, `truncated_fraction` (responses that hit
        `max_tokens`), `verifier_errors`, with `multi_turn` `tool_call_fraction` (the
        responses that called a tool), `mean_tool_calls` and `tool_errors` (errors and
        timeouts), and `mean_sampled_token_nll`: the mean of -log p(sampled token) over the
        policy's sampled tokens, named for what it is. That is a one-sample Monte Carlo
        estimate of the entropy of the distribution the tokens were sampled from (the
        temperature-scaled, top-k/top-p filtered one), equal to the model's token entropy in
        expectation only at temperature 1 without filters. Token-level means weight every
        sampled token equally.
    """
    from cagrpo_ray.data.prompts import format_prompt

    items = list(items)
    if not items:
        raise ValueError("evaluate needs at least one item")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    sampling = dataclasses.replace(sampling, n=samples)
    prompts = [format_prompt(tokenizer, item.question, instruction) for item in items]
    groups = engine.generate(prompts, sampling)
    if len(groups) != len(items) or any(len(group) != samples for group in groups):
        shape = [len(group) for group in groups]
        raise RuntimeError(
            f"the engine returned groups of sizes {shape[:8]}... for {len(items)} prompts; "
            f"expected {len(items)} groups of {samples}"
        )
    completions = [completion for group in groups for completion in group]
    results = reward_fn(
        [completion.text for completion in completions],
        [item for item in items for _ in range(samples)],
    )

    per_prompt = []
    for index, item in enumerate(items):
        rows = range(index * samples, (index + 1) * samples)
        correct = [bool(results[row].correct) for row in rows]
        answers = [extract_answer(completions[row].text) for row in rows]
        winner = majority_answer(answers)
        per_prompt.append(
            {
                "uid": item.uid,
                "num_correct": sum(correct),
                "majority_answer": None if winner is None else answers[winner],
                f"maj@{samples}": maj_at_k(answers, correct),
            }
        )

    metrics: dict[str, Any] = {"num_prompts": len(items), "samples": samples}
    for k in k_values(samples):
        metrics[f"pass@{k}"] = _mean(
            [pass_at_k(samples, record["num_correct"], k) for record in per_prompt]
        )
    metrics[f"maj@{samples}"] = _mean([record[f"maj@{samples}"] for record in per_prompt])
    metrics["mean_reward"] = _mean([result.reward for result in results])
    for name in results[0].components:
        metrics[f"mean_{name}"] = _mean([result.components[name] for result in results])
    metrics["verifier_errors"] = sum(result.error is not None for result in results)
    metrics["mean_response_tokens"] = _mean([len(c.token_ids) for c in completions])
    metrics["truncated_fraction"] = _mean([c.finish_reason == "length" for c in completions])
    if multi_turn:
        # multi-turn episodes (`cagrpo_ray/env`): how often and how well the tools were used
        metrics["tool_call_fraction"] = _mean([c.tool_calls > 0 for c in completions])
        metrics["mean_tool_calls"] = _mean([c.tool_calls for c in completions])
        metrics["tool_errors"] = sum(c.tool_errors + c.tool_timeouts for c in completions)
    metrics.update(_entropy(completions))
    if details:
        metrics["per_prompt"] = per_prompt
    return metrics


def _entropy(completions: list[Completion]) -> dict[str, float]:
    logprobs = [  # the policy's tokens only: a tool result's tokens were sampled by nobody
        value
        for c in completions
        for value, mine in zip(c.logprobs, c.from_policy or repeat(True))  # noqa: B905
        if mine
    ]
    return {"mean_sampled_token_nll": -_mean(logprobs) if logprobs else math.nan}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if len(values) else math.nan


def print_results(metrics: dict[str, Any], title: str = "evaluation") -> None:
    """The numbers of `evaluate`'s result as a two-column table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
