"""Reward functions of one's own, named in the config: `reward.functions: {name: spec}`.

`spec` is `path/to/file.py:function` or `module:function`. Three calling conventions are
recognised from the function's parameters, so that a function written for verl or TRL runs
unchanged:

- **TRL** (`GRPOTrainer(reward_funcs=...)`): a parameter named `completions`. Called once per
  batch with keyword arguments `prompts` (each item's prompt: text, or chat messages),
  `completions` (text; for a prompt of chat messages, `[{"role": "assistant", "content":
  text}]`), `completion_ids` (token ids, or None where the caller has none) and every other
  dataset column as a list over the batch; returns one `float | None` per completion (None:
  no reward for that sample, which then counts 0 and is no error).
- **verl** (`custom_reward_function`, `default_compute_score`): a parameter named
  `solution_str`. Called per response as `compute_score(data_source=, solution_str=,
  ground_truth=, extra_info=)`; returns a float, or a dict whose `score` is the reward and
  whose other numeric keys are components (`<name>/<key>`).
- **the project's own** (`cagrpo_ray/rewards/verifiers.py`): `(response, item) -> float`,
  `item` the `PromptItem` as a dict.

Functions run in the verifier pool's worker processes (`rewards/pool.py`), under its timeout
and hard kill. A `UserRewardFunction` carries only strings, so it pickles to the workers,
which import the function themselves. An exception, a NaN or infinite score, or a wrong list
length scores 0 with an error that names the function and the sample.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cagrpo_ray.errors import UserError
from cagrpo_ray.imports import import_source

# (score, error or None, extra components)
Scored = tuple[float, str | None, dict[str, float]]

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")
SIGNATURES = (
    "TRL's (prompts, completions, completion_ids, **columns) -> list[float | None], "
    "verl's compute_score(data_source, solution_str, ground_truth, extra_info) -> "
    "float | dict, or (response, item) -> float"
)

_loaded: dict[str, Callable] = {}  # spec -> function, per process


class RewardFunctionError(UserError, ValueError):
    """A reward function that cannot be used: not importable, or an unknown signature."""


@dataclass(frozen=True)
class UserRewardFunction:
    """A reward function named `name`, loaded from `spec`, called in its convention `kind`
    ("trl", "verl" or "item"). `search_path` is where `module:function` specs are found
    besides `sys.path` (the directory the run was started from)."""

    name: str
    spec: str
    kind: str
    search_path: str

    @property
    def batched(self) -> bool:
        """Whether one call scores a whole batch (TRL) rather than one response."""
        return self.kind == "trl"

    def function(self) -> Callable:
        if self.spec not in _loaded:
            _loaded[self.spec] = import_function(self.name, self.spec, self.search_path)
        return _loaded[self.spec]

    def score_job(self, response: str | list[str], item: dict | list[dict]):
        """A pool job: one `Scored` per response (a list of them for a batched function).

        Never raises: a failing call comes back as a zero score with its error."""
        if self.batched:
            return self._score_batch(response, item)
        try:
            if self.kind == "verl":
                return self._verl(response, item)
            return _checked(self.name, item, self.function()(response, item), {})
        except Exception as error:
            return 0.0, self._error(item, f"raised {type(error).__name__}: {error}"), {}

    def _verl(self, response: str, item: dict) -> Scored:
        metadata = item.get("metadata") or {}
        arguments = {
            "data_source": metadata.get("data_source"),
            "solution_str": response,
            "ground_truth": item["answer"],
            "extra_info": metadata.get("extra_info"),
        }
        function = self.function()
        value = function(**_accepted(function, arguments))
        components: dict[str, float] = {}
        if isinstance(value, Mapping):
            if "score" not in value:
                return 0.0, self._error(item, f"returned a dict without 'score': {value!r}"), {}
            components = {
                f"{self.name}/{key}": float(v)
                for key, v in value.items()
                if key != "score" and _is_real(v) and math.isfinite(float(v))
            }
            value = value["score"]
        return _checked(self.name, item, value, components)

    def _score_batch(self, responses: list[str], items: list[dict]) -> list[Scored]:
        function = self.function()
        conversational = [isinstance(item.get("question"), list) for item in items]
        columns = sorted({key for item in items for key in item.get("metadata") or {}})
        arguments: dict[str, Any] = {
            "prompts": [item.get("question") for item in items],
            "completions": [
                [{"role": "assistant", "content": text}] if chat else text
                for text, chat in zip(responses, conversational, strict=True)
            ],
            "completion_ids": [item.get("completion_ids") for item in items],
        }
        for column in columns:
            if column not in arguments and column != "source_file":
                arguments[column] = [(item.get("metadata") or {}).get(column) for item in items]
        try:
            values = function(**_accepted(function, arguments))
        except Exception as error:
            reason = f"raised {type(error).__name__}: {error}"
            return [(0.0, self._error(item, reason), {}) for item in items]
        if not isinstance(values, (list, tuple)) or len(values) != len(items):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            reason = f"returned {got} rewards for a batch of {len(items)} completions"
            return [(0.0, self._error(item, reason), {}) for item in items]
        return [
            (0.0, None, {}) if value is None else _checked(self.name, item, value, {})
            for value, item in zip(values, items, strict=True)
        ]

    def _error(self, item: dict, reason: str) -> str:
        return _error(self.name, item, reason)


def _error(name: str, item: dict, reason: str) -> str:
    return f"reward function {name!r} on sample {item.get('uid')!r} {reason[:300]}"


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) or type(value).__name__ in ("float32", "float64")


def _checked(name: str, item: dict, value: Any, components: dict[str, float]) -> Scored:
    """`value` as a score, or a zero with an error if it is not a finite number."""
    if not _is_real(value) and not hasattr(value, "__float__"):
        return 0.0, _error(name, item, f"returned {type(value).__name__}, not a number"), {}
    score = float(value)
    if not math.isfinite(score):
        return 0.0, _error(name, item, f"returned {score}"), {}
    return score, None, components


def _accepted(function: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """The `arguments` that `function` takes (all of them if it has **kwargs)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return arguments
    names = {p.name for p in parameters}
    return {key: value for key, value in arguments.items() if key in names}


def import_function(name: str, spec: str, search_path: str | None = None) -> Callable:
    """The function that `spec` ("file.py:function" or "module:function") names."""
    target, _, attribute = spec.rpartition(":")
    if not target or not attribute:
        raise RewardFunctionError(
            f"reward function {name!r}: {spec!r} is not 'path/to/file.py:function' or "
            "'module:function'"
        )
    try:
        module = import_source(target, search_path)
    except Exception as error:
        raise RewardFunctionError(
            f"reward function {name!r}: cannot import {target!r}: {type(error).__name__}: "
            f"{error}"
        ) from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardFunctionError(
            f"reward function {name!r}: {target!r} has no function {attribute!r}"
        )
    return function


def calling_convention(name: str, function: Callable) -> str:
    """"trl", "verl" or "item", from `function`'s parameters; raises `RewardFunctionError`
    naming the function and the signatures it may have."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as error:
        raise RewardFunctionError(f"reward function {name!r}: no signature ({error})") from error
    parameters = signature.parameters
    required = [
        p.name
        for p in parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if "completions" in parameters:
        positional_only = [
            p.name for p in parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY
        ]
        if not positional_only:
            return "trl"
    elif "solution_str" in parameters:
        if set(required) <= set(VERL_ARGUMENTS):
            return "verl"
    else:
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        positional = [p for p in parameters.values() if p.kind in kinds]
        takes_two = len(positional) >= 2 or any(
            p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()
        )
        if takes_two and len(required) <= 2:
            return "item"
    raise RewardFunctionError(
        f"reward function {name!r} has the signature {name}{signature}; expected {SIGNATURES}"
    )


def load_reward_functions(
    functions: Mapping[str, str], search_path: str | None = None
) -> dict[str, UserRewardFunction]:
    """Name -> `UserRewardFunction` for each `name: spec`, each imported and its signature
    checked here, so that a run stops before it trains. Relative file paths are resolved
    against `search_path` (default: the working directory)."""
    base = Path(search_path or os.getcwd()).resolve()
    loaded = {}
    for name, spec in functions.items():
        target, colon, attribute = spec.rpartition(":")
        if colon and target.endswith(".py"):
            spec = f"{(base / target).resolve()}:{attribute}"
        function = import_function(name, spec, str(base))
        kind = calling_convention(name, function)
        loaded[name] = UserRewardFunction(name, spec, kind, str(base))
    return loaded
