"""Prompt formatting through the tokenizer's chat template, with the R1-style instruction."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

R1_INSTRUCTION = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>."
)

# For tokenizers without a chat template (base models): DeepSeek-R1-Zero's plain template.
PLAIN_TEMPLATE = "{instruction}User: {question}\nAssistant:"


def format_prompt_text(
    tokenizer, question: str | list[dict], instruction: str | list[dict] | None = R1_INSTRUCTION
) -> str:
    """The prompt text: `question` as the user turn, `instruction` as the system turn (or, a
    list of messages, the turns before it: a system turn and worked examples, `data.few_shot`).

    A `question` that is a list of chat messages (verl's and TRL's conversational layouts) is
    the conversation itself, after the instruction's turns; a system turn of its own replaces
    the instruction's.

    The chat template decides how (and whether) the system turn is rendered: the small
    character-level policies' template leaves it out, because they were trained without it
    (see `cagrpo_ray/policies/tokenizer.py`). The text ends with the template's generation
    prompt, so that the response starts at the assistant's first token (`<think>`).
    """
    if isinstance(question, list):
        if tokenizer.chat_template is None:
            raise ValueError("a prompt of chat messages needs a tokenizer with a chat template")
        preamble = (
            [{"role": "system", "content": instruction}]
            if isinstance(instruction, str)
            else list(instruction or [])
        )
        if any(message["role"] == "system" for message in question):
            preamble = [message for message in preamble if message["role"] != "system"]
        return tokenizer.apply_chat_template(
            [*preamble, *question], tokenize=False, add_generation_prompt=True
        )
    if isinstance(instruction, list):
        if tokenizer.chat_template is None:
            raise ValueError("example turns (data.few_shot) need a tokenizer with a chat template")
        messages = [*instruction, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if tokenizer.chat_template is None:
        prefix = f"{instruction}\n" if instruction else ""
        return PLAIN_TEMPLATE.format(instruction=prefix, question=question)
    messages = [{"role": "user", "content": question}]
    if instruction:
        messages.insert(0, {"role": "system", "content": instruction})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def format_prompt(
    tokenizer, question: str | list[dict], instruction: str | list[dict] | None = R1_INSTRUCTION
) -> list[int]:
    """Token ids of `format_prompt_text(tokenizer, question, instruction)`.

    Encoded without adding special tokens again: the chat template writes its own bos.
    """
    text = format_prompt_text(tokenizer, question, instruction)
    return tokenizer.encode(text, add_special_tokens=tokenizer.chat_template is None)


def prompt_preamble(data) -> str | list[dict] | None:
    """What a run puts before each problem, from its `data` config section: `instruction`
    resolved ('r1': the R1 instruction, 'none': nothing, else the text), and with `few_shot`
    the system turn and the example turns as messages (`format_prompt`)."""
    text = {"r1": R1_INSTRUCTION, "none": None}.get(data.instruction, data.instruction)
    if not data.few_shot:
        return text
    system = [{"role": "system", "content": text}] if text else []
    return system + [dict(m) for m in data.few_shot]


class PromptTooLongError(ValueError):
    """Prompts that leave no room for a response in `rollout.max_model_len`; names each."""


def check_prompt_lengths(
    items: Iterable, tokenizer, instruction, max_model_len: int, where: Callable[[Any], str]
) -> None:
    """Raise `PromptTooLongError` if any item's formatted prompt has `max_model_len` tokens or
    more (the engine would refuse it, and cutting it would change the task), naming the first
    few by `where(item)` (file and row) with their lengths. Prompts are never shortened."""
    too_long = []
    for item in items:
        length = len(format_prompt(tokenizer, item.question, instruction))
        if length >= max_model_len:
            too_long.append(f"{where(item)}: {length} tokens")
    if too_long:
        shown = "; ".join(too_long[:5])
        raise PromptTooLongError(
            f"{len(too_long)} prompts are at least rollout.max_model_len ({max_model_len}) "
            f"tokens long, leaving no room for a response ({shown}); raise "
            "rollout.max_model_len or drop these rows"
        )
