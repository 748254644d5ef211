"""A reward function in TRL's convention (`GRPOTrainer(reward_funcs=[accuracy_reward])`; here
`reward.functions: {accuracy: examples/trl_conversational/reward.py:accuracy_reward}`).

TRL calls it once per batch with `prompts`, `completions`, `completion_ids` and every other
dataset column (here `solution` and `operation`) as keyword arguments; a conversational
dataset's completions are message lists. It returns one reward per completion, or None for a
completion it does not score.
"""

import re

ANSWER = re.compile(r"Answer:\s*\$?(-?[\d,]+(?:\.\d+)?)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number after 'Answer:', else the last number of the text."""
    found = ANSWER.findall(text) or NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def accuracy_reward(completions, solution, **kwargs):
    rewards = []
    for completion, answer in zip(completions, solution, strict=True):
        number = final_number(completion[0]["content"])
        rewards.append(1.0 if number is not None and float(number) == float(answer) else 0.0)
    return rewards
