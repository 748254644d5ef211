"""Prompt sources, formatting and worked solutions."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cagrpo_ray.data import (
    R1_INSTRUCTION,
    BadRowError,
    FilePromptSource,
    PromptFileError,
    PromptItem,
    PromptSource,
    ReasoningGymSource,
    format_prompt,
    format_prompt_text,
    worked_solution,
)
from cagrpo_ray.policies.tokenizer import char_tokenizer

CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


# --- reasoning_gym -----------------------------------------------------------------------------


@pytest.mark.unit
def test_reasoning_gym_items_carry_what_the_verifier_needs():
    source = ReasoningGymSource("chain_sum", CHAIN_SUM, seed=3, size=5)
    assert isinstance(source, PromptSource)
    item = source[2]
    assert item.uid == "chain_sum:train:2"
    assert item.question.endswith("=") and "State the final answer" in item.question
    assert item.metadata["source_dataset"] == "chain_sum"
    assert isinstance(item.answer, str)
    assert int(item.answer) == eval(item.metadata["expression"])
    json.dumps(item.metadata)


@pytest.mark.unit
def test_reasoning_gym_is_deterministic_for_a_seed_and_differs_across_seeds():
    first = [i.question for i in ReasoningGymSource("chain_sum", CHAIN_SUM, seed=7, size=50)]
    again = [i.question for i in ReasoningGymSource("chain_sum", CHAIN_SUM, seed=7, size=50)]
    other = [i.question for i in ReasoningGymSource("chain_sum", CHAIN_SUM, seed=8, size=50)]
    assert first == again
    assert first != other


@pytest.mark.unit
def test_adjacent_seeds_overlap_in_reasoning_gym_itself():
    # The pitfall the split offsets guard against: item idx is seeded with seed + idx.
    a = ReasoningGymSource("chain_sum", CHAIN_SUM, seed=0, size=20)
    b = ReasoningGymSource("chain_sum", CHAIN_SUM, seed=1, size=20)
    assert a[1].question == b[0].question


@pytest.mark.unit
def test_eval_split_is_disjoint_from_training_splits_and_has_no_repeats():
    # 1-digit sums of 2 or 3 terms: about 4,200 distinct questions, so training splits of
    # 3,000 draws cover most 2-term ones and a naive eval split would repeat them.
    small = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
    train = ReasoningGymSource("chain_sum", small, seed=0, size=2000, split="train")
    sft = ReasoningGymSource("chain_sum", small, seed=0, size=1000, split="sft")
    held_out = ReasoningGymSource(
        "chain_sum",
        small,
        seed=0,
        size=10,
        split="eval",
        exclude_sizes={"train": 2000, "sft": 1000},
    )
    seen = {i.question for i in train} | {i.question for i in sft}
    questions = [i.question for i in held_out]
    assert len(questions) == 10 == len(set(questions))
    assert not seen & set(questions)
    naive = ReasoningGymSource("chain_sum", small, seed=0, size=10, split="eval")
    assert seen & {i.question for i in naive}
    assert held_out[0].uid == "chain_sum:eval:0"


@pytest.mark.unit
def test_the_excluded_questions_are_drawn_once_per_process_and_are_the_splits_own():
    import random

    from cagrpo_ray.data.reasoning_gym_source import generate_entries, split_questions

    seed = random.randrange(10_000)  # a fresh region each run: not a case the cache could hold
    config = {"min_terms": 2, "max_terms": 3, "max_digits": 2}
    questions = split_questions("chain_sum", config, seed, 300)
    assert questions == {e["question"] for e in generate_entries("chain_sum", config, seed, 300)}
    assert split_questions("chain_sum", dict(reversed(config.items())), seed, 300) is questions
    assert split_questions("chain_sum", config, seed + 1, 300) != questions


@pytest.mark.unit
def test_eval_split_that_cannot_be_filled_says_so():
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ValueError, match="fewer than 500 questions"):
        ReasoningGymSource("chain_sum", tiny, size=500, split="eval", exclude_sizes={"train": 5000})


@pytest.mark.unit
def test_unknown_split_is_named():
    with pytest.raises(ValueError, match="split 'test'"):
        ReasoningGymSource("chain_sum", CHAIN_SUM, split="test")


@pytest.mark.unit
def test_cursor_resumes_without_skipping_or_replaying():
    source = ReasoningGymSource("chain_sum", CHAIN_SUM, seed=1, size=30)
    consumed = []
    iterator = source.iter_from(0)
    consumed += [next(iterator).uid for _ in range(11)]
    cursor = len(consumed)  # what a checkpoint stores
    resumed = ReasoningGymSource("chain_sum", CHAIN_SUM, seed=1, size=30)
    consumed += [item.uid for item in resumed.iter_from(cursor)]
    assert consumed == [item.uid for item in source]
    assert list(source.iter_from(len(source))) == []
    with pytest.raises(IndexError, match="cursor 31"):
        source.iter_from(31)
    with pytest.raises(IndexError):
        source[30]


# --- files -------------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return path


BAD_JSONL_ROWS = [
    {"problem": "What is 1+1?", "answer": "2", "level": 1},
    {"problem": "What is 2+2?"},  # line 2: no answer
    {"problem": "   ", "answer": "0"},  # line 3: empty prompt
    {"problem": "What is 3+3?", "answer": 6},  # line 4: non-string answer
    "{not json\n",  # line 5
    "\n",  # line 6: blank lines are ignored
    {"problem": "What is 4+4?", "answer": "8"},
]


@pytest.mark.unit
def test_jsonl_source_skips_bad_rows_and_logs_their_count(tmp_path, caplog):
    path = write_jsonl(tmp_path / "math.jsonl", BAD_JSONL_ROWS)
    with caplog.at_level(logging.WARNING):
        source = FilePromptSource(path, on_bad_row="skip")
    assert source.question_column == "problem"
    assert [item.answer for item in source] == ["2", "8"]
    assert [item.uid for item in source] == ["math.jsonl:0", "math.jsonl:6"]
    # every column but the question stays: reward functions get them (TRL passes each)
    assert source[0].metadata == {"answer": "2", "level": 1, "source_file": "math.jsonl"}
    assert source.skipped == 4
    locations = [bad.location for bad in source.bad_rows]
    assert locations == ["line 2", "line 3", "line 4", "line 5"]
    reasons = " | ".join(bad.reason for bad in source.bad_rows)
    assert "no column 'answer'" in reasons and "empty" in reasons and "int, not str" in reasons
    assert "skipped 4 bad rows of 6" in caplog.text and str(path) in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"problem": "ok", "answer": "1"}, {"problem": "x"}], r"math\.jsonl, line 2: no column"),
        ([{"problem": "", "answer": "1"}], r"math\.jsonl, line 1: question 'problem' is empty"),
        ([{"problem": "x", "answer": 3}], r"line 1: answer 'answer' is int, not str"),
        (["[1, 2]\n"], r"line 1: a JSON list, not an object"),
    ],
)
def test_jsonl_source_in_error_mode_names_file_and_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    with pytest.raises(BadRowError, match=message):
        FilePromptSource(path, question_column="problem", on_bad_row="error")


@pytest.mark.unit
def test_parquet_source_with_column_mapping_and_bad_rows(tmp_path):
    table = pa.table(
        {
            "prompt": ["Compute 6*7.", "", "Compute 2**10.", "Compute 1/0."],
            "solution": ["42", "1", "1024", None],
            "source": ["a", "b", "c", "d"],
        }
    )
    path = tmp_path / "open_rs.parquet"
    pq.write_table(table, path)
    source = FilePromptSource(path, answer_column="solution")
    assert source.question_column == "prompt"
    assert [(i.uid, i.question, i.answer) for i in source] == [
        ("open_rs.parquet:0", "Compute 6*7.", "42"),
        ("open_rs.parquet:2", "Compute 2**10.", "1024"),
    ]
    assert [bad.location for bad in source.bad_rows] == ["row 1", "row 3"]
    with pytest.raises(BadRowError, match=r"open_rs\.parquet, row 1: question 'prompt' is empty"):
        FilePromptSource(path, answer_column="solution", on_bad_row="error")


@pytest.mark.unit
def test_file_source_names_what_is_missing(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"text": "hi", "answer": "1"}])
    with pytest.raises(ValueError, match=r"none of the question columns.*\['answer', 'text'\]"):
        FilePromptSource(path)
    with pytest.raises(PromptFileError, match="nope.jsonl"):
        FilePromptSource(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="not .parquet or .jsonl"):
        FilePromptSource(write_jsonl(tmp_path / "q.csv", []))
    with pytest.raises(ValueError, match="on_bad_row"):
        FilePromptSource(path, question_column="text", on_bad_row="ignore")


@pytest.mark.unit
def test_file_source_resumes_from_a_cursor(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    source = FilePromptSource(write_jsonl(tmp_path / "q.jsonl", rows))
    assert [i.answer for i in source.iter_from(7)] == ["7", "8", "9"]
    assert len(source) == 10


# --- prompts and worked solutions --------------------------------------------------------------


@pytest.mark.unit
def test_char_policy_template_leaves_the_instruction_out_and_ends_at_the_assistant_turn():
    tokenizer = char_tokenizer()
    text = format_prompt_text(tokenizer, "1 + 2 =")
    assert text == "<s><|user|>1 + 2 =<|assistant|>"
    assert format_prompt_text(tokenizer, "1 + 2 =", instruction=None) == text
    ids = format_prompt(tokenizer, "1 + 2 =")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == text


class SystemTemplateTokenizer:
    """Stands in for a hub tokenizer whose template renders system turns (as Qwen2.5's does)."""

    chat_template = "set"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        turns = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return turns + ("<|assistant|>" if add_generation_prompt else "")


@pytest.mark.unit
def test_instruction_goes_into_the_system_turn_when_the_template_has_one():
    text = format_prompt_text(SystemTemplateTokenizer(), "What is 2+2?")
    assert text == f"<|system|>{R1_INSTRUCTION}\n<|user|>What is 2+2?\n<|assistant|>"
    assert "<think>" in R1_INSTRUCTION and "<answer>" in R1_INSTRUCTION


@pytest.mark.unit
def test_tokenizer_without_template_gets_the_plain_r1_prompt():
    class Plain(SystemTemplateTokenizer):
        chat_template = None

    text = format_prompt_text(Plain(), "What is 2+2?")
    assert text.startswith(R1_INSTRUCTION) and text.endswith("User: What is 2+2?\nAssistant:")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("expression", "answer", "solution"),
    [
        ("98 + 93 - 77", "114", "<think>98+93=191 191-77=114</think><answer>114</answer>"),
        ("5 + 3", "8", "<think>5+3=8</think><answer>8</answer>"),
        ("-1 - -6 - 6", "-1", "<think>-1--6=5 5-6=-1</think><answer>-1</answer>"),
    ],
)
def test_chain_sum_worked_solution(expression, answer, solution):
    item = PromptItem(
        "u",
        f"... {expression} =",
        answer,
        {"source_dataset": "chain_sum", "expression": expression},
    )
    assert worked_solution(item) == solution


@pytest.mark.unit
def test_worked_solutions_agree_with_reasoning_gym_answers():
    config = {
        "min_terms": 2,
        "max_terms": 6,
        "min_digits": 1,
        "max_digits": 4,
        "allow_negation": True,
    }
    for item in ReasoningGymSource("chain_sum", config, seed=11, size=300):
        assert worked_solution(item).endswith(f"<answer>{item.answer}</answer>")


@pytest.mark.unit
def test_worked_solution_of_an_unknown_task_names_the_known_ones():
    item = PromptItem("u", "q", "a", {"source_dataset": "basic_arithmetic"})
    with pytest.raises(KeyError, match="chain_sum"):
        worked_solution(item)
