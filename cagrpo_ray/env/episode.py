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

import dataclasses
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from cagrpo_ray.env.tools import MAX_OUTPUT_CHARS, TOOLS, ToolResult, run_calculator, run_python
from cagrpo_ray.types import Completion, SamplingConfig

MAX_EPISODE_THREADS = 64  # episodes of one request going on at once (each mostly waits)

TOOL_OPEN, TOOL_CLOSE = "<tool>", "</tool>"
RESULT_TEMPLATE = "<result>{output}</result>"


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


class SingleTurn:
    """The environment of a single-turn task: no stop string, and every turn ends the
    episode. `run_episodes` with it returns the engine's samples as they are."""

    stop: tuple[str, ...] = ()

    def reply(self, turn_text: str) -> EnvReply:
        return EnvReply("", done=True)


SINGLE_TURN = SingleTurn()


class ToolEnvironment:
    """Tools called as `<tool>name: input</tool>` at the end of a turn, answered as
    `<result>output</result>`; a turn that ends without a call ends the episode (its answer
    is scored by the task's verifiers, as a single-turn response is). The tags and the
    reply's template can be a chat template's own (`call_open`, `call_close`,
    `result_template`, with `{output}` where the tool's output goes)."""

    def __init__(
        self,
        tools: Sequence[str] = ("calculator",),
        max_output_chars: int = MAX_OUTPUT_CHARS,
        python_wall_s: float = 2.0,
        call_open: str = TOOL_OPEN,
        call_close: str = TOOL_CLOSE,
        result_template: str = RESULT_TEMPLATE,
    ):
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"unknown tools {unknown}; the tools are {sorted(TOOLS)}")
        if "{output}" not in result_template:
            raise ValueError(f"result_template {result_template!r} has no {{output}}")
        self.stop = (call_close,)
        self.result_template = result_template
        self._call = re.compile(
            rf"{re.escape(call_open)}\s*(?P<name>[A-Za-z_]\w*)\s*:\s*(?P<input>.*?)"
            rf"{re.escape(call_close)}\s*$",
            re.S,
        )
        self.max_output_chars = max_output_chars
        self.tools: dict[str, Callable[[str], ToolResult]] = {}
        if "calculator" in tools:
            self.tools["calculator"] = lambda arg: run_calculator(arg, max_output_chars)
        if "python" in tools:
            self.tools["python"] = lambda arg: run_python(arg, python_wall_s, max_output_chars)

    def reply(self, turn_text: str) -> EnvReply:
        call = self._call.search(turn_text)
        if call is None:
            return EnvReply("", done=True)
        name, argument = call["name"], call["input"]
        tool = self.tools.get(name)
        if tool is None:
            result = ToolResult(f"error: no tool {name!r}; tools: {', '.join(self.tools)}",
                                "error", 0.0)  # fmt: skip
        else:
            try:
                result = tool(argument)
            except Exception as exc:  # a tool's own bug must not end the episode, or the run
                result = ToolResult(f"error: the tool failed ({type(exc).__name__})", "error", 0.0)
        text = self.result_template.replace("{output}", result.text)
        return EnvReply(text, False, result.status, result.seconds)


@dataclass
class Episode:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # after the prompt: policy and env
    from_policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob; 0 for env tokens
    versions: list[int] = field(default_factory=list)  # the policy version of each token
    texts: list[str] = field(default_factory=list)  # each turn's and each reply's text
    finish_reason: str = "stop"  # "stop" | "length" (token budget) | "turns" (max_turns)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    first_version: int = 0  # the version of the first turn's first token

    @property
    def policy_version(self) -> int:
        """Its oldest token's version: what the staleness bound counts."""
        return min(self.versions) if self.versions else self.first_version

    def add_turn(self, completion: Completion) -> None:
        """The policy's turn; with in-flight weight loads its tokens from `t` on are `v`'s."""
        if not self.turns:
            self.first_version = completion.policy_version
        versions = [completion.policy_version] * len(completion.token_ids)
        for t, v in completion.loads:
            versions[t:] = [v] * (len(versions) - t)
        self.token_ids += completion.token_ids
        self.from_policy += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += versions
        self.texts.append(completion.text)
        self.turns += 1

    def add_reply(self, tokens: list[int], text: str) -> None:
        """The environment's tokens: context, sampled by nobody (version of the turn before)."""
        self.token_ids += tokens
        self.from_policy += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [self.versions[-1] if self.versions else self.first_version] * len(tokens)
        self.texts.append(text)

    def completion(self) -> Completion:
        """The episode as one response: what the verifiers score and the learner trains on."""
        loads = [(t, v) for t in range(1, len(self.versions))
                 if (v := self.versions[t]) != self.versions[t - 1]]  # fmt: skip
        return Completion(
            list(self.prompt_token_ids),
            list(self.token_ids),
            list(self.logprobs),
            "".join(self.texts),
            self.finish_reason,
            self.policy_version,
            loads=loads,
            from_policy=None if all(self.from_policy) else list(self.from_policy),
            turns=self.turns,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_timeouts=self.tool_timeouts,
            tool_seconds=self.tool_seconds,
        )


def run_episode(
    generate: Callable[[list[int], int, tuple[str, ...]], Completion],
    env: Environment,
    encode: Callable[[str], list[int]],
    prompt_token_ids: list[int],
    max_turns: int,
    max_tokens: int,
    first: Completion | None = None,
) -> Episode:
    """One episode. `generate(context_ids, max_tokens, stop)` samples one policy turn from
    `context_ids` (token ids; at most `max_tokens` new ones, ending at a `stop` string or the
    end of sequence); `encode(text)` gives the environment's tokens, without special tokens.
    `first`: the first turn, already sampled (`run_episodes` samples every first turn in one
    request)."""
    episode = Episode(list(prompt_token_ids))
    for turn in range(1, max_turns + 1):
        if turn == 1 and first is not None:
            completion = first
        else:
            room = max_tokens - len(episode.token_ids)
            completion = generate(episode.prompt_token_ids + episode.token_ids, room, env.stop)
        episode.add_turn(completion)
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
        episode.add_reply(shown, reply.text if len(shown) == len(observation) else "")
        if len(observation) >= room:
            episode.finish_reason = "length"
            return episode
    episode.finish_reason = "turns"  # the last turn called a tool it has no turn left to read
    return episode


def run_episodes(
    generate: Callable[[list[list[int]], SamplingConfig], list[list[Completion]]],
    env: Environment,
    encode: Callable[[str], list[int]],
    prompts: list[list[int]],
    sampling: SamplingConfig,
    max_turns: int,
    workers: int = MAX_EPISODE_THREADS,
    later: Callable[[list[list[int]], SamplingConfig], list[list[Completion]]] | None = None,
) -> list[list[Completion]]:
    """`sampling.n` episodes per prompt over an engine's `generate` (a batch call, as
    `Engine.generate`), each returned as one `Completion` (`Episode.completion`).

    Every first turn is sampled in one request, exactly as a single-turn batch is (the same
    prompts, seeds and `n`), so an episode whose first turn calls no tool is the single-turn
    response bit for bit. Each episode that goes on samples its next turns alone (n = 1,
    seeded from the request's seed, the sample and the turn), its tool calls run in its own
    thread, and the episodes go on concurrently, so a slow tool holds back only its own.
    `later`: what samples the later turns (default `generate`)."""
    later = later or generate
    first = generate(prompts, dataclasses.replace(sampling, stop=tuple(env.stop)))

    def play(index: int, sample: int, completion: Completion) -> Completion:
        def turn(context: list[int], room: int, stop: tuple[str, ...]) -> Completion:
            seed = sampling.seed
            if seed is not None:  # the context grows every turn: its length tells turns apart
                seed = _turn_seed(seed, index, sample, len(context))
            one = dataclasses.replace(sampling, n=1, max_tokens=room, stop=stop, seed=seed)
            return later([context], one)[0][0]

        episode = run_episode(turn, env, encode, prompts[index], max_turns,
                              sampling.max_tokens, first=completion)  # fmt: skip
        if episode.turns == 1 and not episode.tool_calls:
            return completion  # the engine's sample itself, whatever its weight loads said
        return episode.completion()

    jobs = [(i, j, c) for i, group in enumerate(first) for j, c in enumerate(group)]
    if max_turns == 1:  # nothing goes on: no thread needed (the single-turn tasks)
        played = [play(*job) for job in jobs]
    else:
        with ThreadPoolExecutor(max(1, min(workers, len(jobs))), "episode") as threads:
            played = list(threads.map(lambda job: play(*job), jobs))
    n = sampling.n
    return [played[i * n : (i + 1) * n] for i in range(len(prompts))]


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """How an environment's text becomes tokens of an episode (`run_episodes`'s `encode`):
    the tokenizer's ids alone, no special tokens (the chat template's are in the text)."""
    return partial(tokenizer.encode, add_special_tokens=False)


class EpisodePlayer:
    """An engine whose `generate` plays episodes (`run_episodes`) with `env`: what evaluates a
    multi-turn policy outside a run (`python -m cagrpo_ray.eval --max-turns`)."""

    def __init__(self, engine, env: Environment, max_turns: int, tokenizer):
        self.engine, self.env, self.max_turns = engine, env, max_turns
        self._encode = text_encoder(tokenizer)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig):
        return run_episodes(self.engine.generate, self.env, self._encode, prompts, sampling,
                            self.max_turns)  # fmt: skip


def _turn_seed(seed: int, index: int, sample: int, position: int) -> int:
    """A later turn's seed (from its request's seed, its prompt, sample and first position):
    far from every first turn's, the other episodes' and its own other turns'."""
    mixed = seed
    for part in (index, sample, position):
        mixed = ((mixed ^ (part + 1)) * 0x9E3779B97F4A7C15) % (1 << 64)
        mixed ^= mixed >> 29
    return mixed % (1 << 63)


def environment_options(config) -> dict | None:
    """What a generator replica needs to build the run's environment (`ToolEnvironment`
    arguments and `max_turns`); None for a single-turn run."""
    if config.rollout.max_turns <= 1:
        return None
    return {"max_turns": config.rollout.max_turns, **config.env.model_dump()}
