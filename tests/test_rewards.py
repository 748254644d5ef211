"""Verifiers, answer extraction, and the reward function's process pool under adversarial input."""

from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cagrpo_ray.rewards import (
    RewardFunction,
    RewardResult,
    extract_boxed,
    extract_code,
    extract_final_answer,
    extract_tagged,
)
from cagrpo_ray.rewards.verifiers import (
    verify_format,
    verify_math,
    verify_reasoning_gym,
    verify_task,
)

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

TIMEOUT_S = 1.0
SLACK_S = 1.5  # start-up of the kill and scheduling on a loaded 2-core machine


def hanging_verifier(response: str, item: dict) -> float:
    time.sleep(3600)
    return 1.0


def dying_verifier(response: str, item: dict) -> float:
    os._exit(3)


def raising_verifier(response: str, item: dict) -> float:
    raise KeyError("no such field")


def memory_hog_verifier(response: str, item: dict) -> float:
    return float(len(bytearray(64 << 30)))


def chain_sum_items(n: int, seed: int = 7) -> list:
    # Imported here, not at the top: verifier workers import this module for the verifiers above.
    import reasoning_gym

    from cagrpo_ray.data.types import PromptItem

    dataset = reasoning_gym.create_dataset("chain_sum", seed=seed, size=n)
    return [
        PromptItem(f"chain_sum:test:{i}", e["question"], e["answer"], e["metadata"])
        for i, e in enumerate(dataset)
    ]


def r1(answer: str, thought: str = "step by step") -> str:
    return f"<think>{thought}</think><answer>{answer}</answer>"


# ---------------------------------------------------------------- extraction


@pytest.mark.unit
def test_answer_tag_takes_the_last_complete_one():
    assert extract_tagged("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_tagged("<answer>1</answer> then <answer>3") == "1"
    assert extract_tagged("<answer>unterminated") is None
    assert extract_tagged("</answer> no opening") is None
    assert extract_tagged("") is None


@pytest.mark.unit
def test_boxed_handles_nested_braces_and_unterminated_boxes():
    assert extract_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{a^{b^{c}}} and \boxed{x_{1}+\{y\}}") == r"x_{1}+\{y\}"
    assert extract_boxed(r"\boxed{1} then \boxed{2") == "1"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed("{{{") is None


@pytest.mark.unit
@given(
    st.recursive(
        st.text("ab1+ \\", max_size=4).filter(lambda s: not s.endswith("\\")),
        lambda inner: st.lists(inner, max_size=3).map(lambda parts: "{" + "".join(parts) + "}"),
    )
)
def test_boxed_round_trips_balanced_content(content):
    assert extract_boxed("x \\boxed{" + content + "} y") == content.strip()


@pytest.mark.unit
def test_final_answer_prefers_a_box_inside_the_answer_tag():
    assert extract_final_answer(r"<answer>so \boxed{12}</answer>") == "12"
    assert extract_final_answer("<answer>12</answer>") == "12"
    assert extract_final_answer(r"\boxed{5} <answer>unterminated") == "5"
    assert extract_final_answer("no answer at all") is None


@pytest.mark.unit
def test_code_extraction_takes_the_last_python_block():
    text = "```js\nx\n```\n```python\nprint(1)\n```\ntext ```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("<answer>print(3)</answer>") == "print(3)"
    assert extract_code("```js\nconsole.log(1)\n```") is None


@pytest.mark.unit
def test_extraction_is_linear_on_megabytes_of_unclosed_markup():
    hostile = "<answer>" * 200_000 + "\\boxed{" * 200_000 + "```" * 100_001
    start = time.perf_counter()
    assert extract_final_answer(hostile) is None
    extract_code(hostile)
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------- verifiers, in-process


@pytest.mark.unit
def test_format_requires_think_then_answer_exactly_once():
    assert verify_format(r1("4"), {}) == 1.0
    assert verify_format("  <think>a</think>\n<answer>4</answer>\n</s>", {}) == 1.0
    assert verify_format(r1("4") + "<|im_end|>", {}) == 1.0
    assert verify_format("<answer>4</answer><think>a</think>", {}) == 0.0
    assert verify_format("<think>a</think><answer>4</answer><answer>5</answer>", {}) == 0.0
    assert verify_format("<think>a</think>junk<answer>4</answer>", {}) == 0.0
    assert verify_format("preamble <think>a</think><answer>4</answer>", {}) == 0.0
    assert verify_format("<think>a</think><answer>4</answer> trailing", {}) == 0.0
    assert verify_format("<think>a<answer>4</answer>", {}) == 0.0
    assert verify_format("", {}) == 0.0


@pytest.mark.unit
def test_reasoning_gym_uses_the_datasets_own_score_answer():
    items = chain_sum_items(5)
    for item in items:
        as_dict = item.__dict__
        assert verify_reasoning_gym(r1(item.answer), as_dict) == 1.0
        assert verify_reasoning_gym(r1(str(int(item.answer) + 1)), as_dict) == 0.0
        assert verify_reasoning_gym(f"<think>{item.answer}</think>", as_dict) == 0.0
    # chain_sum compares numerically: a leading '+' and trailing zeros still match
    item = items[0].__dict__
    assert verify_reasoning_gym(r1(f"{int(item['answer']):+d}.00"), item) == 1.0


@pytest.mark.unit
def test_reasoning_gym_needs_the_source_dataset():
    with pytest.raises(ValueError, match="source_dataset"):
        verify_reasoning_gym(r1("1"), {"uid": "x", "answer": "1", "metadata": {}})
    with pytest.raises(ValueError, match="no dataset"):
        verify_reasoning_gym(r1("1"), {"answer": "1", "metadata": {"source_dataset": "nope"}})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response", "gold", "score"),
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        ("<answer>1/2</answer>", r"\frac{1}{2}", 1.0),
        (r"<answer>\boxed{1,000}</answer>", "1000", 1.0),
        (r"\boxed{x^2+1}", "1+x^{2}", 1.0),
        (r"\boxed{\sqrt{2}}", "2^{1/2}", 1.0),
        (r"\boxed{42}", "43", 0.0),
        ("<answer>π</answer>", "3", 0.0),
        ("no answer", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_math_verify_on_latex_and_plain_numbers(response, gold, score):
    assert verify_math(response, {"answer": gold, "metadata": {}}) == score


@pytest.mark.unit
def test_task_verifier_dispatches_on_the_item():
    rg_item = chain_sum_items(1)[0].__dict__
    assert verify_task(r1(rg_item["answer"]), rg_item) == 1.0
    assert verify_task(r"\boxed{\frac{2}{4}}", {"answer": "0.5", "metadata": {}}) == 1.0


# ---------------------------------------------------------------- the reward function


@pytest.fixture(scope="module")
def reward_fn():
    fn = RewardFunction(
        {"reasoning_gym": 1.0, "format": 0.1},
        timeout_s=TIMEOUT_S,
        num_workers=2,
    )
    yield fn
    fn.close()


@pytest.fixture(scope="module")
def adversarial_fn():
    fn = RewardFunction(
        {"math": 1.0, "hang": 0.0, "die": 0.0, "raise": 0.0, "hog": 0.0},
        timeout_s=TIMEOUT_S,
        num_workers=2,
        extra_verifiers={
            "hang": hanging_verifier,
            "die": dying_verifier,
            "raise": raising_verifier,
            "hog": memory_hog_verifier,
        },
    )
    yield fn
    fn.close()


@pytest.mark.unit
def test_weighted_sum_and_correct_flag(reward_fn):
    items = chain_sum_items(4)
    responses = [
        r1(items[0].answer),  # right, well formed
        f"<answer>{items[1].answer}</answer>",  # right, no think
        r1("999999"),  # wrong, well formed
        "I don't know",  # nothing
    ]
    results = reward_fn(responses, items)
    assert all(isinstance(r, RewardResult) for r in results)
    assert [r.correct for r in results] == [True, True, False, False]
    assert [r.reward for r in results] == pytest.approx([1.1, 1.0, 0.1, 0.0])
    assert results[0].components == {"reasoning_gym": 1.0, "format": 1.0}
    assert all(r.error is None for r in results)


@pytest.mark.unit
def test_adversarial_responses_score_without_errors(reward_fn):
    items = chain_sum_items(6)
    answer = items[0].answer
    responses = [
        "",
        "x" * (4 << 20) + r1(answer),  # 4 MB of filler, then a right answer
        "<answer>" * 300_000,  # 2.4 MB of unterminated tags
        r1(answer, thought="ünïcödé ∑∫ 😀 \u202e\x00"),
        r1("{" * 1000 + "}" * 999),
        "<think>" + "{}" * 100_000 + "</think><answer>" + answer,  # unterminated answer
    ]
    items = [items[0]] * len(responses)
    results = reward_fn(responses, items)
    assert [r.error for r in results] == [None] * len(responses)
    assert [r.correct for r in results] == [False, True, False, True, False, False]


@pytest.mark.unit
def test_mismatched_lengths_and_unknown_verifiers_are_refused(reward_fn):
    with pytest.raises(ValueError, match="2 responses but 1 items"):
        reward_fn(["a", "b"], chain_sum_items(1))
    with pytest.raises(TypeError, match="responses\\[0\\]"):
        reward_fn([None], chain_sum_items(1))
    with pytest.raises(ValueError, match="unknown verifiers \\['nope'\\]"):
        RewardFunction({"nope": 1.0})


@pytest.mark.unit
def test_crashing_dying_and_memory_hungry_verifiers_score_zero_with_an_error(adversarial_fn):
    item = {"answer": "3", "metadata": {}}
    [result] = adversarial_fn([r"\boxed{3}"], [item])
    assert result.correct and result.reward == 1.0  # the math component still counts
    assert result.components == {"math": 1.0, "hang": 0.0, "die": 0.0, "raise": 0.0, "hog": 0.0}
    assert "hang timed out after 1 s" in result.error
    assert "die killed its worker (exit code 3)" in result.error
    assert "raise raised KeyError" in result.error
    assert "hog raised MemoryError" in result.error
    assert adversarial_fn.pool.restarts == 2  # the hanging one and the dead one


@pytest.mark.unit
def test_a_hanging_verifier_is_killed_on_time_and_the_pool_recovers():
    extra = {"hang": hanging_verifier}
    with RewardFunction({"math": 1.0, "hang": 0.0}, TIMEOUT_S, 2, extra_verifiers=extra) as fn:
        item = {"answer": "3", "metadata": {}}
        fn([r"\boxed{3}"], [item])  # one worker hangs and is replaced
        fn.pool.wait_ready()
        start = time.monotonic()
        [result] = fn([r"\boxed{3}"], [item])
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert result.correct and result.error == "hang timed out after 1 s"


@pytest.mark.unit
def test_math_verify_on_a_pathological_power_tower_times_out():
    with RewardFunction({"math": 1.0}, timeout_s=TIMEOUT_S, num_workers=1) as fn:
        item = {"answer": "1", "metadata": {}}
        fn([r"\boxed{1}"], [item])
        start = time.monotonic()
        [tower] = fn([r"\boxed{9^{9^{9^{9}}}}"], [item])
        assert time.monotonic() - start < TIMEOUT_S + SLACK_S
        assert tower.reward == 0.0 and "math timed out" in tower.error
        [fine] = fn([r"\boxed{1}"], [item])
        assert fine.correct and fine.error is None


@pytest.mark.unit
def test_works_off_the_main_thread(reward_fn):
    items = chain_sum_items(2)
    results = []
    thread = threading.Thread(
        target=lambda: results.extend(reward_fn([r1(items[1].answer)], items[1:]))
    )
    thread.start()
    thread.join(timeout=30)
    assert [r.correct for r in results] == [True]


@pytest.mark.unit
def test_close_is_idempotent_and_final():
    fn = RewardFunction({"format": 1.0}, timeout_s=TIMEOUT_S, num_workers=1)
    assert fn([r1("1")], [{"answer": "1", "metadata": {}}])[0].reward == 1.0
    processes = [worker.process for worker in fn.pool._workers]
    fn.close()
    fn.close()
    assert all(process.poll() is not None for process in processes)
    with pytest.raises(RuntimeError, match="closed"):
        fn([r1("1")], [{"answer": "1", "metadata": {}}])
