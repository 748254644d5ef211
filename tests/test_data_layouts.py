"""Prompt files in verl's, TRL's and OpenRLHF's layouts, `datasets` folders, dotted columns,
chat-message prompts and the prompt-length check (`cagrpo_ray/data/files.py`, `prompts.py`)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cagrpo_ray.data import (
    BadRowError,
    FilePromptSource,
    PromptFileError,
    PromptTooLongError,
    check_prompt_lengths,
    detect_format,
    format_prompt,
    format_prompt_text,
)
from cagrpo_ray.data.files import column_value
from cagrpo_ray.policies.tokenizer import char_tokenizer

pytestmark = pytest.mark.unit


class ChatTokenizer:
    """A stand-in with a chat template: `<|role|>content` per turn, `<|assistant|>` to
    generate; one token per character."""

    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens):
        return [ord(c) for c in text]


def verl_row(i: int, question: str, answer: str) -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": i, "question": question},
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_verl_parquet_gives_messages_ground_truth_and_keeps_the_rest(tmp_path):
    rows = [verl_row(0, "Tom has 3 apples and buys 4. How many?", "7"),
            verl_row(1, "What is 6 times 7?", "42")]  # fmt: skip
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    source = FilePromptSource(path)
    assert source.format == "verl"
    assert (source.question_column, source.answer_column) == (
        "prompt",
        "reward_model.ground_truth",
    )
    item = source[1]
    assert item.uid == "train.parquet:1"
    assert item.question == [{"role": "user", "content": "What is 6 times 7?"}]
    assert item.answer == "42"
    assert item.metadata["data_source"] == "openai/gsm8k"
    assert item.metadata["ability"] == "math"
    assert item.metadata["extra_info"] == {"split": "train", "index": 1,
                                           "question": "What is 6 times 7?"}  # fmt: skip
    assert item.metadata["reward_model"]["ground_truth"] == "42"
    assert "prompt" not in item.metadata
    assert source.where(item) == f"{path}, row 1"


def test_trl_standard_and_conversational_keep_every_other_column(tmp_path):
    standard = write_jsonl(
        tmp_path / "std.jsonl",
        [{"prompt": "2+2?", "solution": "4", "level": 1}],
    )
    source = FilePromptSource(standard, answer_column="solution")
    assert source.format == "trl"
    assert (source[0].question, source[0].answer) == ("2+2?", "4")
    assert source[0].metadata == {"solution": "4", "level": 1, "source_file": "std.jsonl"}
    conversational = tmp_path / "conv.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "3+4?"}],
              "solution": "7", "difficulty": "easy"}]  # fmt: skip
        ),
        conversational,
    )
    item = FilePromptSource(conversational, answer_column="solution")[0]
    assert item.question[1] == {"role": "user", "content": "3+4?"}
    assert item.answer == "7" and item.metadata["difficulty"] == "easy"


def test_openrlhf_jsonl_is_detected_by_input_and_label(tmp_path):
    path = write_jsonl(
        tmp_path / "rl.jsonl",
        [{"input": "What is 5-2?", "label": "3", "datasource": "toy"},
         {"input": [{"role": "user", "content": "What is 9-1?"}], "label": "8"}],  # fmt: skip
    )
    source = FilePromptSource(path)
    assert source.format == "openrlhf"
    assert [(i.question, i.answer) for i in source] == [
        ("What is 5-2?", "3"),
        ([{"role": "user", "content": "What is 9-1?"}], "8"),
    ]
    # and named, with the columns OpenRLHF's --input_key/--label_key would name
    named = FilePromptSource(path, question_column="input", answer_column="label", format="plain")
    assert [i.answer for i in named] == ["3", "8"]


@pytest.mark.parametrize(
    ("columns", "layout"),
    [
        ({"prompt", "reward_model", "data_source"}, "verl"),
        ({"input", "label"}, "openrlhf"),
        ({"prompt", "solution"}, "trl"),
        ({"problem", "prompt", "answer"}, "plain"),  # "problem" first, as before the layouts
        ({"question", "answer"}, "plain"),
    ],
)
def test_layout_detection(columns, layout):
    assert detect_format(columns) == layout


def test_format_named_overrides_detection(tmp_path):
    # a verl-looking file read as TRL's: the answer then comes from the named column
    path = tmp_path / "v.parquet"
    row = {**verl_row(0, "1+1?", "2"), "final": "two"}
    pq.write_table(pa.Table.from_pylist([row]), path)
    source = FilePromptSource(path, format="trl", answer_column="final")
    assert source.format == "trl" and source[0].answer == "two"
    with pytest.raises(ValueError, match="format must be one of auto, plain, verl, trl"):
        FilePromptSource(path, format="sharegpt")


def test_dotted_paths_reach_nested_columns_and_name_the_missing_part(tmp_path):
    row = {"a": {"b": {"c": "x"}}, "a.b": "literal"}
    assert column_value(row, "a.b.c") == "x"
    assert column_value(row, "a.b") == "literal"  # a column named with a dot wins
    with pytest.raises(KeyError, match="'a.z'"):
        column_value(row, "a.z.c")
    path = write_jsonl(
        tmp_path / "nested.jsonl",
        [{"q": {"text": "1+2?"}, "meta": {"gold": "3"}}, {"q": {"text": "2+2?"}, "meta": {}}],
    )
    source = FilePromptSource(path, question_column="q.text", answer_column="meta.gold")
    assert [(i.question, i.answer) for i in source] == [("1+2?", "3")]
    assert str(source.bad_rows[0]) == (
        f"{path}, line 2: no column 'meta.gold' (columns: ['meta', 'q'])"
    )


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ([], "not a non-empty list of chat messages"),
        ([{"role": "user"}], "message 0 is {'role': 'user'}, not {role, content}"),
        ([{"role": "robot", "content": "hi"}], "message 0 has role 'robot'"),
        ([{"role": "user", "content": 3}], "message 0's content is int, not str"),
        ([{"role": "user", "content": "  "}], "every message is empty"),
        (7, "question 'prompt' is int, not str or a list of chat messages"),
    ],
)
def test_bad_message_rows_name_file_and_row(tmp_path, prompt, reason):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"prompt": "fine", "answer": "1"}, {"prompt": prompt, "answer": "2"}],
    )
    with pytest.raises(BadRowError) as error:
        FilePromptSource(path, format="trl", on_bad_row="error")
    assert str(error.value).startswith(f"{path}, line 2: ")
    assert reason in str(error.value)
    assert len(FilePromptSource(path, format="trl")) == 1  # skipped by default


def test_datasets_folder_is_read_with_the_datasets_library(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [verl_row(i, f"What is {i}+1?", str(i + 1)) for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    source = FilePromptSource(tmp_path / "one")
    assert source.format == "verl"
    assert [i.answer for i in source] == ["1", "2", "3"]
    assert source[2].question == [{"role": "user", "content": "What is 2+1?"}]
    assert source.where(source[2]) == f"{tmp_path / 'one'}, row 2"
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows)}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(PromptFileError, match=r"several splits; name the folder of one: .*train"):
        FilePromptSource(tmp_path / "dict")
    assert len(FilePromptSource(tmp_path / "dict" / "test")) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptFileError, match="not one that datasets.save_to_disk wrote"):
        FilePromptSource(tmp_path / "empty")


def test_message_prompts_render_with_the_chat_template_after_the_preamble():
    tokenizer = ChatTokenizer()
    user = [{"role": "user", "content": "2+2?"}]
    assert format_prompt_text(tokenizer, user, "Think.") == (
        "<|system|>Think.<|user|>2+2?<|assistant|>"
    )
    assert format_prompt_text(tokenizer, user, None) == "<|user|>2+2?<|assistant|>"
    own_system = [{"role": "system", "content": "Be brief."}, *user]
    few_shot = [
        {"role": "system", "content": "Think."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
    ]
    # the data's own system turn replaces the instruction's; the example turns stay
    assert format_prompt_text(tokenizer, own_system, few_shot) == (
        "<|user|>1+1?<|assistant|>2<|system|>Be brief.<|user|>2+2?<|assistant|>"
    )
    # text prompts are unchanged: the instruction as the system turn, the text as the user's
    assert format_prompt_text(tokenizer, "2+2?", "Think.") == (
        format_prompt_text(tokenizer, user, "Think.")
    )


def test_message_prompts_through_a_real_hf_chat_template():
    tokenizer = char_tokenizer()
    messages = [{"role": "user", "content": "12+3="}]
    assert format_prompt(tokenizer, messages, None) == format_prompt(tokenizer, "12+3=", None)


def test_message_prompts_need_a_chat_template():
    class Plain(ChatTokenizer):
        chat_template = None

    with pytest.raises(ValueError, match="chat messages needs a tokenizer with a chat template"):
        format_prompt_text(Plain(), [{"role": "user", "content": "x"}], None)


def test_a_prompt_past_max_model_len_is_reported_with_file_row_and_length(tmp_path):
    tokenizer = ChatTokenizer()
    long_question = "x" * 100
    rows = [
        {"prompt": "short?", "answer": "1"},
        {"prompt": long_question, "answer": "2"},
        {"prompt": [{"role": "user", "content": long_question + "y"}], "answer": "3"},
    ]
    source = FilePromptSource(write_jsonl(tmp_path / "long.jsonl", rows))
    length = len(f"<|user|>{long_question}<|assistant|>")  # one token per character
    check_prompt_lengths(source, tokenizer, None, length + 2, source.where)  # all fit
    with pytest.raises(PromptTooLongError) as error:
        check_prompt_lengths(source, tokenizer, None, length + 1, source.where)
    message = str(error.value)
    assert message.startswith("1 prompts are at least rollout.max_model_len")
    assert f"{tmp_path / 'long.jsonl'}, line 3: {length + 1} tokens" in message
    with pytest.raises(PromptTooLongError) as error:
        check_prompt_lengths(source, tokenizer, None, length, source.where)
    assert str(error.value).startswith("2 prompts")
    assert f"line 2: {length} tokens" in str(error.value)
    assert "line 1" not in str(error.value)


def test_file_sources_from_the_data_section_check_both_files(tmp_path):
    from cagrpo_ray.config.sections import DataConfig
    from cagrpo_ray.data.files import file_sources

    train = write_jsonl(tmp_path / "train.jsonl", [{"input": "1+1?", "label": "2"}] * 3)
    held_out = write_jsonl(
        tmp_path / "test.jsonl",
        [{"input": "2+2?", "label": "4"}, {"input": "9" * 50, "label": "9"}],
    )
    data = DataConfig(source="file", path=str(train), eval_path=str(held_out),
                      instruction="none", eval_size=1)  # fmt: skip
    source, eval_items = file_sources(data, ChatTokenizer(), 40)
    assert source.format == "openrlhf" and len(source) == 3
    assert [i.answer for i in eval_items] == ["4"]  # the long row is past eval_size
    data.eval_size = 2
    with pytest.raises(PromptTooLongError, match=r"test\.jsonl, line 2: 71 tokens"):
        file_sources(data, ChatTokenizer(), 40)
