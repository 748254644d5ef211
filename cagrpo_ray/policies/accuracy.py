"""Held-out accuracy of a policy with HF `generate`, scored by reasoning_gym's own verifier."""

from __future__ import annotations

import re

import reasoning_gym
import torch
from transformers import GenerationConfig

from cagrpo_ray.data.prompts import format_prompt
from cagrpo_ray.data.types import PromptItem

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """The text inside the last `<answer>...</answer>` of a response, or None without one."""
    matches = _ANSWER.findall(response)
    return matches[-1] if matches else None


def is_correct(response: str, item: PromptItem) -> bool:
    """Whether the tagged answer of `response` gets full marks from the dataset's score_answer."""
    answer = extract_answer(response)
    if answer is None:
        return False
    score_answer = reasoning_gym.get_score_answer_fn(item.metadata["source_dataset"])
    entry = {"question": item.question, "answer": item.answer, "metadata": item.metadata}
    return score_answer(answer, entry) == 1.0


@torch.no_grad()
def generate_responses(
    model,
    tokenizer,
    items: list[PromptItem],
    *,
    sample: bool,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 128,
) -> tuple[list[str], list[int]]:
    """One response per item, sampled at temperature 1 (no top-k, no top-p) or greedy: the
    texts and their lengths in tokens (eos included when generated).

    Prompts are left-padded, as batched `generate` needs; special tokens are dropped from the
    text, R1 tags are not (they are ordinary tokens).
    """
    if sample:
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    else:
        config = GenerationConfig(do_sample=False)
    config.max_new_tokens = max_new_tokens
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model.eval()
    torch.manual_seed(seed)
    responses, lengths = [], []
    for start in range(0, len(items), batch_size):
        prompts = [
            format_prompt(tokenizer, item.question) for item in items[start : start + batch_size]
        ]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config
        )
        generated = output[:, width:]
        responses += tokenizer.batch_decode(generated, skip_special_tokens=True)
        # generate pads finished rows with pad after their eos
        lengths += (generated != tokenizer.pad_token_id).sum(dim=1).tolist()
    return responses, lengths


def accuracy(
    model, tokenizer, items: list[PromptItem], *, sample: bool, max_new_tokens: int, seed: int = 0
) -> tuple[float, list[str], list[int]]:
    """Fraction of `items` answered correctly, the responses and their lengths in tokens."""
    responses, lengths = generate_responses(
        model, tokenizer, items, sample=sample, max_new_tokens=max_new_tokens, seed=seed
    )
    correct = sum(
        is_correct(response, item) for response, item in zip(responses, items, strict=True)
    )
    return correct / len(items), responses, lengths
