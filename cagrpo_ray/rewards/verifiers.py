"""The verifiers: each maps one response and its prompt item to a score, usually in [0, 1].

A verifier is a plain function `(response: str, item: dict) -> float`; `item` is a
`PromptItem` as a dict (`uid`, `question`, `answer`, `metadata`). They run inside the reward
pool's worker processes (`cagrpo_ray/rewards/pool.py`), which enforce the per-call timeout, so
none of them carries a timeout of its own; math-verify's signal-based timeouts are off.

Task verifiers (their verdict is the accuracy metric: score >= 1 is correct) are
`reasoning_gym` (the answer tag), `reasoning_gym_text` (the final answer of free text, as a
pretrained instruct model writes it), `math`, `code`, and `task`, which picks one of
reasoning_gym, code and math per item. `answer_parser(name)` is the extraction each one applies,
so that the reward pool can count the responses in which it found no answer at all.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from cagrpo_ray.rewards.extract import (
    extract_answer_text,
    extract_code,
    extract_final_answer,
    extract_tagged,
    is_number,
    normalize_number,
    strip_trailing_special_tokens,
)
from cagrpo_ray.rewards.sandbox import SandboxLimits, outputs_match, run_solution

Verifier = Callable[[str, dict], float]

TASK_VERIFIERS = frozenset({"reasoning_gym", "reasoning_gym_text", "math", "code", "task"})


def verify_reasoning_gym(response: str, item: dict) -> float:
    """The reasoning_gym dataset's own `score_answer` on the `<answer>` tag's content.

    The dataset is `item["metadata"]["source_dataset"]`. Datasets whose scoring reads their
    config (e.g. `decimal_arithmetic`, `puzzle24`, `time_intervals`) take it from
    `item["metadata"]["dataset_config"]` when present, else use their default config.
    """
    return _score_reasoning_gym(extract_tagged(response, "answer"), item)


def verify_reasoning_gym_text(response: str, item: dict) -> float:
    """The reasoning_gym dataset's `score_answer` on the final answer of free text.

    For pretrained models that answer in sentences: the answer is found by
    `extract_answer_text` (an answer tag, a box, "Answer: ...", else the last number), and a
    number is normalised ("1,000." -> "1000", "42.0" -> "42"). A number against a numeric
    reference is right or wrong (1 or 0); anything else the dataset's `score_answer` scores.
    """
    answer, _ = extract_answer_text(response)
    reference = str(item["answer"]).strip()
    if answer is not None and is_number(answer) and is_number(reference):
        # numbers compare as numbers: no partial credit for "10" against "1", as the
        # datasets' default string scoring gives (0.5 when the reference is a substring)
        return 1.0 if float(answer) == float(normalize_number(reference)) else 0.0
    return _score_reasoning_gym(answer, item)


def _score_reasoning_gym(answer: str | None, item: dict) -> float:
    metadata = item.get("metadata") or {}
    name = metadata.get("source_dataset")
    if not name:
        raise ValueError(
            f"item {item.get('uid')!r} has no metadata['source_dataset']; the reasoning_gym "
            "verifier needs the dataset name (use 'math' or 'code' for other items)"
        )
    config = json.dumps(metadata.get("dataset_config") or {}, sort_keys=True)
    score_answer = _reasoning_gym_scorer(name, config)
    entry = {"question": item.get("question", ""), "answer": item["answer"], "metadata": metadata}
    return float(score_answer(answer, entry))


@functools.lru_cache(maxsize=256)
def _reasoning_gym_scorer(name: str, config_json: str) -> Callable[[Any, dict], float]:
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(f"reasoning_gym has no dataset {name!r}; known: {len(DATASETS)} names")
    dataset_cls, config_cls = DATASETS[name]
    return dataset_cls(config=config_cls(**json.loads(config_json))).score_answer


def verify_math(response: str, item: dict) -> float:
    """math-verify equivalence of the final answer (boxed or tagged) and `item["answer"]`.

    Both sides are parsed as the content of a `\\boxed{}`, with LaTeX and plain-expression
    extraction, so `\\frac{1}{2}`, `1/2` and `0.5` agree, as do `1,000` and `1000`. 1.0 or 0.0.
    """
    answer = extract_final_answer(response)
    if not answer:
        return 0.0
    from math_verify import verify

    gold = _parse_reference(str(item["answer"]))
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {item['answer']!r}")
    return 1.0 if verify(gold, _parse_math(answer), timeout_seconds=None) else 0.0


@functools.lru_cache(maxsize=4096)
def _parse_reference(text: str) -> list:
    return _parse_math(text)  # a GRPO group scores G responses against one reference


def _parse_math(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" notices
    return parse(
        "\\boxed{" + text + "}",
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=None,
    )


def verify_format(response: str, item: dict) -> float:
    """1.0 when the response is `<think>...</think>` then `<answer>...</answer>`, else 0.0.

    The R1 format reward (`^<think>.*?</think>\\s*<answer>.*?</answer>$`), made strict: exactly
    one of each tag, think first, answer after it, only whitespace around and between them.
    Special tokens the engine left at the end of the text (`</s>`, `<|im_end|>`, ...) are
    ignored.
    """
    text = strip_trailing_special_tokens(response)
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(text.count(tag) != 1 for tag in tags):
        return 0.0
    think_open, think_close, answer_open, answer_close = (text.find(tag) for tag in tags)
    ordered = think_open == 0 and think_open < think_close < answer_open < answer_close
    if not ordered or text[think_close + len("</think>") : answer_open].strip():
        return 0.0
    return 1.0 if answer_close + len("</answer>") == len(text) else 0.0


def verify_code(response: str, item: dict, limits: SandboxLimits | None = None) -> float:
    """Fraction of the item's test cases that the response's Python solution passes.

    The code is the last fenced Python block (or the answer tag's content), run once in the
    sandbox (`cagrpo_ray/rewards/sandbox.py`) under `limits`. Test cases, in
    `item["metadata"]` (a list or its JSON string):

    - `test_cases`: `[{"input": stdin, "output": expected stdout}, ...]`, or the APPS shape
      `{"inputs": [...], "outputs": [...]}`; outputs compare token by token, whitespace aside;
    - `tests`: assert statements run after the solution, e.g. `["assert add(1, 2) == 3"]`.
    """
    inputs, expected, asserts = code_tests(item)
    code = extract_code(response)
    if code is None:
        return 0.0
    run = run_solution(code, inputs, asserts, limits)
    passed = sum(
        status == "ok" and outputs_match(output, want)
        for status, output, want in zip(run.case_status, run.outputs, expected, strict=True)
    )
    passed += sum(status == "ok" for status in run.assert_status)
    return passed / (len(inputs) + len(asserts))


def code_tests(item: dict) -> tuple[list[str], list[str], list[str]]:
    """(stdin inputs, expected outputs, assert statements) of a code item; raises if none."""
    metadata = item.get("metadata") or {}
    cases = _maybe_json(metadata.get("test_cases")) or []
    if isinstance(cases, dict):
        cases = [
            {"input": i, "output": o}
            for i, o in zip(cases.get("inputs", []), cases.get("outputs", []), strict=True)
        ]
    inputs = [str(case["input"]) for case in cases]
    expected = [str(case["output"]) for case in cases]
    asserts = [str(test) for test in (_maybe_json(metadata.get("tests")) or [])]
    if not inputs and not asserts:
        raise ValueError(
            f"item {item.get('uid')!r} has no metadata['test_cases'] or metadata['tests']; "
            "the code verifier needs at least one test"
        )
    return inputs, expected, asserts


def _maybe_json(value):
    return json.loads(value) if isinstance(value, str) else value


def verify_task(response: str, item: dict, code_limits: SandboxLimits | None = None) -> float:
    """The task verifier that fits the item: reasoning_gym items (with `source_dataset`) by
    their dataset, items with test cases by running code, everything else by math-verify."""
    kind = task_kind(item)
    if kind == "reasoning_gym":
        return verify_reasoning_gym(response, item)
    if kind == "code":
        return verify_code(response, item, code_limits)
    return verify_math(response, item)


def task_kind(item: dict) -> str:
    """Which verifier `task` applies to `item`: reasoning_gym, code or math."""
    metadata = item.get("metadata") or {}
    if metadata.get("source_dataset"):
        return "reasoning_gym"
    if metadata.get("test_cases") or metadata.get("tests"):
        return "code"
    return "math"


def answer_parser(name: str) -> Callable[[str, dict], bool] | None:
    """For a task verifier: `(response, item) -> bool`, whether its extraction found an answer
    (a code block for code items); None for a verifier that parses no answer (format)."""

    def tagged(response: str, item: dict) -> bool:
        return extract_tagged(response, "answer") is not None

    def free_text(response: str, item: dict) -> bool:
        return extract_answer_text(response)[0] is not None

    def final(response: str, item: dict) -> bool:
        return extract_final_answer(response) is not None

    def code(response: str, item: dict) -> bool:
        return extract_code(response) is not None

    parsers = {"reasoning_gym": tagged, "reasoning_gym_text": free_text, "math": final,
               "code": code}  # fmt: skip

    def task(response: str, item: dict) -> bool:
        return parsers[task_kind(item)](response, item)

    return {**parsers, "task": task}.get(name)


def answer_extractor(weights) -> Callable[[str], str | None]:
    """The final answer of a response as the task verifiers among `weights` read it: free text
    with `reasoning_gym_text`, else the answer tag or a box (for the majority vote)."""
    if "reasoning_gym_text" in weights:
        return lambda response: extract_answer_text(response)[0]
    return extract_final_answer


def builtin_verifiers(code_limits: SandboxLimits | None = None) -> dict[str, Verifier]:
    """Name -> verifier for every verifier this package defines, code ones under `code_limits`."""
    return {
        "reasoning_gym": verify_reasoning_gym,
        "reasoning_gym_text": verify_reasoning_gym_text,
        "math": verify_math,
        "format": verify_format,
        "code": functools.partial(verify_code, limits=code_limits),
        "task": functools.partial(verify_task, code_limits=code_limits),
    }
