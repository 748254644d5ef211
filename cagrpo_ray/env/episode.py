"""A multi-turn episode: the policy writes until it calls a tool, reads the tool's result, and
goes on, up to `max_turns` turns and `max_tokens` tokens after the prompt.

Token in, token out: each turn is sampled from the conversation so far as token ids (the
prompt, every token the policy sampled, and the environment's tokens), never re-tokenised
from text, so the tokens the learner trains on are exactly the ones sampled. The episode
records, per token, who produced it (`from_policy`), the behaviour log-prob of each policy
token (0 for the environment's) and the policy version that sampled it; the environment's
tokens are context for the learner, never trained on (`response_mask` is `from_policy`).

The single-turn tasks are the case `max_turns = 1`: one call of `generate`, no tool.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cagrpo_ray.env.tools import MAX_OUTPUT_CHARS, TOOLS, ToolResult, run_calculator, run_python
from cagrpo_ray.rollout.types import Completion

TOOL_CLOSE = "</tool>"
_CALL = re.compile(r"<tool>\s*(?P<name>[A-Za-z_]\w*)\s*:\s*(?P<input>.*?)</tool>\s*$", re.S)


@dataclass(frozen=True)
class EnvReply:
    """What the environment answers a policy turn: `text` to append as its tokens, or done."""

    text: str
    done: bool
    status: str | None = None  # the tool's status ("ok", "error", "timeout"); None: no tool
    seconds: float = 0.0


class Environment(Protocol):
    stop: tuple[str, ...]  # strings that end a policy turn (beside the end of sequence)

    def reply(self, turn_text: str) -> EnvReply: ...


class ToolEnvironment:
    """Tools called as `<tool>name: input</tool>` at the end of a turn, answered as
    `<result>output</result>`; a turn that ends without a call ends the episode (its answer
    is scored by the task's verifiers, as a single-turn response is)."""

    stop = (TOOL_CLOSE,)

    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        max_output_chars: int = MAX_OUTPUT_CHARS,
        python_wall_s: float = 2.0,
    ):
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tools are {sorted(TOOLS)}")
        self.max_output_chars = max_output_chars
        self.tools: dict[str, Callable[[str], ToolResult]] = {}
        if "calculator" in tools:
            self.tools["calculator"] = lambda arg: run_calculator(arg, max_output_chars)
        if "python" in tools:
            self.tools["python"] = lambda arg: run_python(arg, python_wall_s, max_output_chars)

    def reply(self, turn_text: str) -> EnvReply:
        call = _CALL.search(turn_text)
        if call is None:
            return EnvReply("", done=True)
        name, argument = call["name"], call["input"]
        tool = self.tools.get(name)
        if tool is None:
            result = ToolResult(f"error: no tool {name!r}; tools: {', '.join(self.tools)}",
                                "error", 0.0)  # fmt: skip
        else:
            result = tool(argument)
        return EnvReply(f"<result>{result.text}</result>", False, result.status, result.seconds)


@dataclass
class Episode:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # after the prompt: policy and env
    from_policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob; 0 for env tokens
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    finish_reason: str = "stop"  # "stop" | "length" (token budget) | "turns" (max_turns)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0

    @property
    def policy_version(self) -> int:
        """Its oldest token's version: what the staleness bound counts."""
        return min(self.versions) if self.versions else 0

    def add(self, tokens: list[int], by_policy: bool, logprobs: list[float], version: int):
        self.token_ids += tokens
        self.from_policy += [by_policy] * len(tokens)
        self.logprobs += logprobs
        self.versions += [version] * len(tokens)


def run_episode(
    generate: Callable[[list[int], int, tuple[str, ...]], Completion],
    env: Environment,
    encode: Callable[[str], list[int]],
    prompt_token_ids: list[int],
    max_turns: int,
    max_tokens: int,
) -> Episode:
    """One episode. `generate(context_ids, max_tokens, stop)` samples one policy turn from
    `context_ids` (token ids; at most `max_tokens` new ones, ending at a `stop` string or the
    end of sequence); `encode(text)` gives the environment's tokens, without special tokens."""
    episode = Episode(list(prompt_token_ids))
    for turn in range(1, max_turns + 1):
        room = max_tokens - len(episode.token_ids)
        completion = generate(episode.prompt_token_ids + episode.token_ids, room, env.stop)
        episode.turns = turn
        episode.add(completion.token_ids, True, completion.logprobs, completion.policy_version)
        if completion.finish_reason == "length":
            episode.finish_reason = "length"
            return episode
        reply = env.reply(completion.text)
        if reply.done:
            episode.finish_reason = "stop"
            return episode
        episode.tool_calls += 1
        episode.tool_errors += reply.status == "error"
        episode.tool_timeouts += reply.status == "timeout"
        episode.tool_seconds += reply.seconds
        observation = encode(reply.text)
        room = max_tokens - len(episode.token_ids)
        shown = observation[:room]
        episode.add(shown, False, [0.0] * len(shown), completion.policy_version)
        if len(observation) >= room:
            episode.finish_reason = "length"
            return episode
    episode.finish_reason = "turns"  # the last turn called a tool it has no turn left to read
    return episode
