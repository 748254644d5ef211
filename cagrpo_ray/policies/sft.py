"""Supervised warm start: next-token loss on the worked solutions, prompt tokens masked."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cagrpo_ray.data.prompts import format_prompt
from cagrpo_ray.data.types import PromptItem
from cagrpo_ray.progress import Progress

IGNORE = -100  # label of tokens that carry no loss (prompt, padding)


def encode_examples(tokenizer, items: list[PromptItem], targets: list[str]) -> list[tuple]:
    """(prompt + response token ids, number of prompt tokens) per example; responses end in eos."""
    responses = tokenizer(targets, add_special_tokens=False)["input_ids"]
    examples = []
    for item, response in zip(items, responses, strict=True):
        prompt = format_prompt(tokenizer, item.question)
        examples.append((prompt + response + [tokenizer.eos_token_id], len(prompt)))
    return examples


def collate(examples: list[tuple], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids [B, L], attention_mask [B, L], labels [B, L] (IGNORE off-response)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, (ids, prompt_length) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, prompt_length : len(ids)] = input_ids[row, prompt_length : len(ids)]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def shared_prefix_length(examples: list[tuple]) -> int:
    """Length of the token prefix that every prompt of the batch shares."""
    first = examples[0][0]
    length = min(prompt_length for _, prompt_length in examples)
    for ids, _ in examples[1:]:
        while length and ids[:length] != first[:length]:
            length -= 1
    return length


def response_loss(model, batch: dict[str, torch.Tensor], prefix_length: int) -> torch.Tensor:
    """Mean next-token loss over the labelled tokens of a right-padded batch.

    All prompts of a task start with the same chat-template header and task sentence (61 of
    about 90 tokens for chain_sum), so the shared prefix runs through the model once, its
    keys and values are repeated over the batch, and only the rest runs per example. This is
    the same function as the full forward pass (same loss and gradients to float rounding),
    at about a third of the cost; the prefix's labels are all masked, so nothing is lost.
    """
    if prefix_length < 2:
        return model(**batch).loss
    input_ids, attention_mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    cache = model(input_ids=input_ids[:1, :prefix_length], use_cache=True).past_key_values
    cache.batch_repeat_interleave(input_ids.shape[0])
    positions = torch.arange(prefix_length, input_ids.shape[1]).expand(input_ids.shape[0], -1)
    return model(
        input_ids=input_ids[:, prefix_length:],
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        labels=labels[:, prefix_length:],
    ).loss


def warmup_cosine(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """Learning-rate factor: linear warm-up over `warmup` steps, then cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train_sft(
    model,
    examples: list[tuple],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    pad_token_id: int,
    progress: bool = True,
    should_stop: Callable[[int], bool] | None = None,
) -> list[float]:
    """AdamW on the mean token loss of the responses, `batch_size` examples a step in order.

    `examples` must hold at least `steps * batch_size` examples; each is used once. After each
    step, `should_stop(step)` may end training early (the schedule still spans `steps`).
    Returns the loss of every step run.
    """
    if len(examples) < steps * batch_size:
        raise ValueError(f"{len(examples)} examples for {steps} steps of {batch_size}")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, steps, warmup_steps)
    )
    model.train()
    losses = []
    bar = Progress(steps, "warm start", enabled=progress)
    for step in range(steps):
        chunk = examples[step * batch_size : (step + 1) * batch_size]
        loss = response_loss(model, collate(chunk, pad_token_id), shared_prefix_length(chunk))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        bar.update(loss=f"{losses[-1]:.3f}")
        if should_stop is not None and should_stop(step):
            break
    bar.close(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
