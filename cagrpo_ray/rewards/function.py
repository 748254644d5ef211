"""The reward of a response: a weighted sum of verifier scores, computed in the verifier pool."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cagrpo_ray.rewards.pool import VerifierPool
from cagrpo_ray.rewards.sandbox import SandboxLimits
from cagrpo_ray.rewards.verifiers import (
    TASK_VERIFIERS,
    Verifier,
    answer_parser,
    builtin_verifiers,
)


@dataclass(frozen=True)
class RewardResult:
    """The reward of one response.

    `reward` is the weighted sum of `components` (verifier name -> score); `correct` is the
    task verifiers' verdict (every task verifier in the weights scored >= 1), the accuracy
    metric; `error` says which verifier crashed or timed out (its component then counts 0).
    """

    reward: float
    correct: bool
    components: dict[str, float]
    error: str | None = None
    parsed: bool = True  # the first task verifier's extraction found an answer (or a code block)


class RewardFunction:
    """`reward = sum_v weights[v] * score_v(response, item)` over the verifiers named in `weights`.

    Every verifier call runs in a `VerifierPool` worker with a hard `timeout_s`. A weight of 0
    still computes the component (e.g. `{"task": 1.0, "format": 0.0}` reports the format rate
    without rewarding it).

    Args:
        weights: verifier name -> weight; names from `builtin_verifiers()` or `extra_verifiers`.
        timeout_s: wall-clock budget of one verifier call (seconds).
        num_workers: verifier processes.
        code_limits: sandbox limits of the `code` verifier; by default its wall-clock budget
            is 80% of `timeout_s`, so that the sandbox's own deadline stops a slow solution
            before the pool has to kill the worker.
        extra_verifiers: more name -> verifier functions (module-level, so picklable).
        task_verifiers: names whose verdict is `correct`; by default the built-in task
            verifiers (reasoning_gym, math, code, task).
    """

    def __init__(
        self,
        weights: Mapping[str, float],
        timeout_s: float = 5.0,
        num_workers: int = 2,
        *,
        code_limits: SandboxLimits | None = None,
        extra_verifiers: Mapping[str, Verifier] | None = None,
        task_verifiers: Iterable[str] = TASK_VERIFIERS,
    ):
        if not weights:
            raise ValueError("weights is empty; name at least one verifier, e.g. {'task': 1.0}")
        code_limits = code_limits or SandboxLimits(wall_s=0.8 * timeout_s)
        if code_limits.wall_s >= timeout_s:
            raise ValueError(
                f"code_limits.wall_s ({code_limits.wall_s}) must be below timeout_s "
                f"({timeout_s}), so that the sandbox stops a slow solution itself"
            )
        verifiers = {**builtin_verifiers(code_limits), **(extra_verifiers or {})}
        unknown = set(weights) - set(verifiers)
        if unknown:
            raise ValueError(f"unknown verifiers {sorted(unknown)}; known: {sorted(verifiers)}")
        self.weights = {name: float(weight) for name, weight in weights.items()}
        self.task_names = sorted(set(task_verifiers) & set(self.weights))
        parsers = [answer_parser(name) for name in self.task_names]
        self._parser = next((p for p in parsers if p is not None), None)
        self.pool = VerifierPool(
            {name: verifiers[name] for name in self.weights}, num_workers, timeout_s
        )

    def __call__(self, responses: Sequence[str], items: Sequence[Any]) -> list[RewardResult]:
        """One `RewardResult` per response; `items[i]` is the `PromptItem` of `responses[i]`."""
        if len(responses) != len(items):
            raise ValueError(f"{len(responses)} responses but {len(items)} items")
        for index, response in enumerate(responses):
            if not isinstance(response, str):
                raise TypeError(f"responses[{index}] is {type(response).__name__}, not str")
        as_dicts: dict[int, dict] = {}
        item_dicts = [as_dicts.setdefault(id(item), _item_dict(item)) for item in items]
        names = list(self.weights)
        scores = self.pool.map(
            [
                (name, response, item)
                for response, item in zip(responses, item_dicts, strict=True)
                for name in names
            ]
        )
        results = []
        for index in range(len(responses)):
            row = scores[index * len(names) : (index + 1) * len(names)]
            components = {name: score for name, (score, _) in zip(names, row, strict=True)}
            errors = [error for _, error in row if error]
            correct = bool(self.task_names) and all(
                components[name] >= 1.0 for name in self.task_names
            )
            results.append(
                RewardResult(
                    reward=sum(self.weights[name] * components[name] for name in names),
                    correct=correct,
                    components=components,
                    error="; ".join(errors) or None,
                    parsed=self._parser is None
                    or self._parser(responses[index], item_dicts[index]),
                )
            )
        return results

    def close(self) -> None:
        """Stop the verifier processes."""
        self.pool.close()

    def __enter__(self) -> RewardFunction:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _item_dict(item: Any) -> dict:
    """A PromptItem (or any object with its fields, or a dict) as a plain, picklable dict."""
    if isinstance(item, Mapping):
        return {
            "uid": item.get("uid"),
            "question": item.get("question", ""),
            "answer": item["answer"],
            "metadata": dict(item.get("metadata") or {}),
        }
    return {
        "uid": item.uid,
        "question": item.question,
        "answer": item.answer,
        "metadata": dict(item.metadata or {}),
    }
