"""Worked solutions in the R1 format, the warm-start targets of the small policies.

A worked solution shows each intermediate step inside `<think>...</think>` and then the answer
inside `<answer>...</answer>`, e.g. `<think>98+93=191 191-77=114</think><answer>114</answer>`,
so that a policy trained on them reasons over tens of tokens and can go wrong mid-chain.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from cagrpo_ray.data.types import PromptItem

_CHAIN_TERM = re.compile(r"([+-])\s+(-?\d+)")


def chain_sum_solution(item: PromptItem) -> str:
    """Running partial sums of a reasoning_gym `chain_sum` expression, left to right."""
    expression = item.metadata["expression"]
    first, _, rest = expression.partition(" ")
    total = int(first)
    steps = []
    for operator, operand in _CHAIN_TERM.findall(rest):
        value = int(operand)
        new_total = total + value if operator == "+" else total - value
        steps.append(f"{total}{operator}{value}={new_total}")
        total = new_total
    if str(total) != item.answer.strip():
        raise ValueError(f"worked solution of {expression!r} gives {total}, not {item.answer!r}")
    return f"<think>{' '.join(steps)}</think><answer>{total}</answer>"


def chain_sum_tool_solution(item: PromptItem) -> str:
    """The same answer by a calculator call (`cagrpo_ray/env`): the expression goes to the
    tool, its result comes back, and the answer repeats it."""
    expression = item.metadata["expression"]
    total = chain_sum_solution(item).rpartition("<answer>")[2].removesuffix("</answer>")
    return (f"<think><tool>calculator: {expression}</tool><result>{total}</result></think>"
            f"<answer>{total}</answer>")  # fmt: skip


WORKED_SOLUTIONS: dict[str, Callable[[PromptItem], str]] = {"chain_sum": chain_sum_solution}
# Worked solutions that call a tool (a multi-turn warm start's share of its examples).
TOOL_SOLUTIONS: dict[str, Callable[[PromptItem], str]] = {"chain_sum": chain_sum_tool_solution}


def worked_solution(item: PromptItem, tool: bool = False) -> str:
    """The R1-format worked solution of a reasoning_gym item, by its `source_dataset`; with
    `tool`, the one that calls the calculator."""
    name = item.metadata.get("source_dataset")
    table = TOOL_SOLUTIONS if tool else WORKED_SOLUTIONS
    if name not in table:
        raise KeyError(
            f"no worked solution{' with a tool' if tool else ''} for {name!r}; tasks with "
            f"them: {sorted(table)}"
        )
    return table[name](item)
