"""The reward of a response: a weighted sum of verifier scores, computed in the verifier pool."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cagrpo_ray.rewards.custom import load_reward_functions
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

    `reward` is the weighted sum of the weighted verifiers' `components` (verifier name ->
    score; a reward function's dict adds `<name>/<key>` components, not in the sum);
    `correct` is the task verifiers' verdict (every task verifier in the weights scored >= 1),
    the accuracy metric; `error` says which verifier crashed or timed out (its component then
    counts 0).
    """

    reward: float
    correct: bool
    components: dict[str, float]
    error: str | None = None
    parsed: bool = True  # the first task verifier's extraction found an answer (or a code block)


class RewardError(RuntimeError):
    """A verifier or reward function failed and `on_error` is "raise"."""


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
            verifiers (reasoning_gym, math, code, task). With none of them in `weights`, the
            reward functions (`functions`) in it give the verdict.
        functions: reward functions of one's own, name -> "path/to/file.py:function" or
            "module:function" (`rewards/custom.py`: TRL's, verl's or the `(response, item)`
            convention); each is imported and its signature checked here.
        on_error: "zero" (a failing call scores 0, with `RewardResult.error`) or "raise"
            (`RewardError` naming the verifier and the sample).
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
        functions: Mapping[str, str] | None = None,
        on_error: str = "zero",
    ):
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', not {on_error!r}")
        if not weights:
            raise ValueError("weights is empty; name at least one verifier, e.g. {'task': 1.0}")
        code_limits = code_limits or SandboxLimits(wall_s=0.8 * timeout_s)
        if code_limits.wall_s >= timeout_s:
            raise ValueError(
                f"code_limits.wall_s ({code_limits.wall_s}) must be below timeout_s "
                f"({timeout_s}), so that the sandbox stops a slow solution itself"
            )
        verifiers = {**builtin_verifiers(code_limits), **(extra_verifiers or {})}
        clashes = set(functions or {}) & set(verifiers)
        if clashes:
            raise ValueError(f"reward functions {sorted(clashes)} reuse a built-in verifier name")
        user = load_reward_functions(functions or {})
        verifiers.update(user)
        unknown = set(weights) - set(verifiers)
        if unknown:
            raise ValueError(f"unknown verifiers {sorted(unknown)}; known: {sorted(verifiers)}")
        self.weights = {name: float(weight) for name, weight in weights.items()}
        self.on_error = on_error
        self.batched = {name for name in self.weights if name in user and user[name].batched}
        self.task_names = sorted(set(task_verifiers) & set(self.weights)) or sorted(
            set(user) & set(self.weights)
        )
        parsers = [answer_parser(name) for name in self.task_names]
        self._parser = next((p for p in parsers if p is not None), None)
        self.pool = VerifierPool(
            {name: verifiers[name] for name in self.weights}, num_workers, timeout_s
        )

    def __call__(
        self,
        responses: Sequence[str],
        items: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RewardResult]:
        """One `RewardResult` per response; `items[i]` is the `PromptItem` of `responses[i]`,
        `completion_ids[i]` its token ids (for TRL-convention functions; None: not known)."""
        if len(responses) != len(items):
            raise ValueError(f"{len(responses)} responses but {len(items)} items")
        for index, response in enumerate(responses):
            if not isinstance(response, str):
                raise TypeError(f"responses[{index}] is {type(response).__name__}, not str")
        as_dicts: dict[int, dict] = {}
        item_dicts = [as_dicts.setdefault(id(item), _item_dict(item)) for item in items]
        names = list(self.weights)
        per_sample = [name for name in names if name not in self.batched]
        jobs = [
            (name, response, item)
            for response, item in zip(responses, item_dicts, strict=True)
            for name in per_sample
        ]
        if self.batched:
            ids = list(completion_ids) if completion_ids is not None else [None] * len(items)
            batch_items = [
                {**item, "completion_ids": None if i is None else list(i)}
                for item, i in zip(item_dicts, ids, strict=True)
            ]
            jobs += [(name, list(responses), batch_items) for name in sorted(self.batched)]
        scores = self.pool.map(jobs)
        # (sample index, verifier name) -> (score, error, extra components)
        scored: dict[tuple[int, str], tuple] = {}
        for job, score in zip(jobs, scores, strict=True):
            if job[0] in self.batched:
                if isinstance(score, tuple):  # the whole call failed (timeout, dead worker)
                    score = [(0.0, f"{score[1]} (batch of {len(responses)})")] * len(responses)
                for index, one in enumerate(score):
                    scored[index, job[0]] = one
        for k, score in enumerate(scores[: len(per_sample) * len(responses)]):
            scored[k // len(per_sample), per_sample[k % len(per_sample)]] = score
        results = []
        for index in range(len(responses)):
            row = [(name, *scored[index, name]) for name in names]
            components = {name: score for name, score, *_ in row}
            for _, _, _, *extra in row:
                components.update(extra[0] if extra else {})
            errors = [error for _, _, error, *_ in row if error]
            if errors and self.on_error == "raise":
                raise RewardError(
                    f"sample {item_dicts[index]['uid']!r}: {'; '.join(errors)} "
                    "(reward.on_error: raise)"
                )
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

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every verifier worker has started (its imports done): the run waits
        for it before its first step, so that a worker that cannot start stops the run there
        and the first step's time is not the workers' start."""
        self.pool.wait_ready(timeout_s)

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
