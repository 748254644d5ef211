"""A reward function in verl's convention (`custom_reward_function.path`/`name` in verl; here
`reward.functions: {gsm8k: examples/verl_gsm8k/reward.py:compute_score}`).

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` once per
response, and so does cagrpo_ray. Like verl's GSM8K scorer, the answer is the number after
"####"; a small instruct model rarely writes that marker, so the last number of the response
counts too (verl's "flexible" method). The dict's `score` is the reward; its other keys are
logged as components (`gsm8k/strict_format`).
"""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(solution_str: str) -> tuple[str | None, bool]:
    """(the final number, whether it followed '####')."""
    marked = re.findall(r"####\s*(-?[\d,.]+)", solution_str)
    if marked:
        return marked[-1].replace(",", "").rstrip("."), True
    numbers = NUMBER.findall(solution_str)
    return (numbers[-1].replace(",", "") if numbers else None), False


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer, strict = extract_answer(solution_str)
    try:
        correct = answer is not None and float(answer) == float(ground_truth)
    except ValueError:
        correct = False
    return {"score": 1.0 if correct else 0.0, "strict_format": 1.0 if strict else 0.0}
