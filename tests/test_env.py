"""Multi-turn episodes (cagrpo_ray/env): the tools, the token-in token-out episode loop, and
that the loss never trains on the environment's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from cagrpo_ray.algo import policy_loss
from cagrpo_ray.env import ToolEnvironment, calculate, run_calculator, run_episode, run_python
from cagrpo_ray.env.tools import MAX_MAGNITUDE, ToolError
from cagrpo_ray.types import Completion

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]


def random_expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 2 or rng.random() < 0.3:
        return str(rng.randint(0, 999)) if rng.random() < 0.8 else f"{rng.uniform(0, 99):.3f}"
    op = rng.choice(["+", "-", "*", "/", "//", "%"])
    left, right = random_expression(rng, depth + 1), random_expression(rng, depth + 1)
    sign = rng.choice(["", "-", "+"])
    return f"{sign}({left} {op} {right})"


def test_the_calculator_agrees_with_python_on_fresh_random_expressions():
    rng = random.Random()  # fresh inputs every run
    checked = 0
    for _ in range(300):
        expression = random_expression(rng)
        try:
            want = eval(expression, {"__builtins__": {}})  # the independent reference
        except ZeroDivisionError:
            with pytest.raises(ToolError, match="division by zero"):
                calculate(expression)
            continue
        if abs(want) > MAX_MAGNITUDE:
            continue
        assert calculate(expression) == pytest.approx(want, rel=1e-12, abs=1e-12), expression
        checked += 1
    assert checked > 200


@pytest.mark.parametrize(
    "expression, why",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x + 1", "not allowed"),
        ("(1).__class__", "not allowed"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 40", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("[1, 2]", "not allowed"),
        ("-" * 3000 + "1", "nested too deeply"),
        ("1+" * 3000 + "1", "nested too deeply"),
        ("(" * 5000 + "1" + ")" * 5000, "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_anything_but_bounded_arithmetic(expression, why):
    result = run_calculator(expression)
    assert result.status == "error" and why in result.text


def test_python_runs_in_the_sandbox_and_every_failure_is_a_message():
    roomy = 15.0  # the calls that should not time out get room for a loaded machine
    assert run_python("print(6 * 7)", wall_s=roomy).text == "42"
    hang = run_python("while True: pass", wall_s=3.0)
    assert hang.status == "timeout" and "3 s limit" in hang.text
    crash = run_python("raise ValueError('boom')", wall_s=roomy)
    assert crash.status == "error" and crash.text.startswith("error:")
    long = run_python("print('x' * 2000)", wall_s=roomy, max_output_chars=50)
    assert long.status == "ok" and len(long.text) < 120 and "cut at 50" in long.text
    flood = run_python("print('x' * 100000)", wall_s=roomy)
    assert flood.status == "error" and "printed more than" in flood.text


def test_the_environment_answers_a_call_at_the_end_of_a_turn_only():
    env = ToolEnvironment(("calculator",))
    assert env.reply("So <tool>calculator: 12 * 34</tool>").text == "<result>408</result>"
    assert env.reply("no call: the answer is 7").done
    unknown = env.reply("<tool>search: cats</tool>")
    assert unknown.status == "error" and "no tool 'search'" in unknown.text
    with pytest.raises(ValueError, match="unknown tools"):
        ToolEnvironment(("browser",))
    broken = ToolEnvironment(("calculator",))
    broken.tools["calculator"] = lambda argument: 1 / 0  # a tool's own bug
    failed = broken.reply("<tool>calculator: 1</tool>")
    assert failed.status == "error" and "ZeroDivisionError" in failed.text and not failed.done


class ScriptedPolicy:
    """Stands in for the engine in this unit of the episode loop: answers each turn with the
    next scripted text, one token per character, and records every context it was given."""

    def __init__(self, turns: list[str]):
        self.turns, self.contexts = list(turns), []

    def __call__(self, context: list[int], max_tokens: int, stop) -> Completion:
        self.contexts.append(list(context))
        text = self.turns.pop(0)
        tokens = [ord(c) for c in text][:max_tokens]
        finish = "stop" if len(tokens) == len(text) else "length"
        logprobs = [-0.01 * (i + 1) for i in range(len(tokens))]
        return Completion(list(context), tokens, logprobs, text[: len(tokens)], finish, 3)


def encode(text: str) -> list[int]:
    return [1000 + ord(c) for c in text]  # environment tokens: told apart in the checks


def test_an_episode_is_its_sampled_tokens_and_the_environments_turn_by_turn():
    prompt = [1, 2, 3]
    policy = ScriptedPolicy(["a<tool>calculator: 2+3</tool>", "so 5"])
    episode = run_episode(policy, ToolEnvironment(), encode, prompt, max_turns=4, max_tokens=200)
    first, reply, second = "a<tool>calculator: 2+3</tool>", "<result>5</result>", "so 5"
    want = [ord(c) for c in first] + encode(reply) + [ord(c) for c in second]
    assert episode.token_ids == want
    assert episode.from_policy == [True] * len(first) + [False] * len(reply) + [True] * 4
    # every turn was sampled from the conversation so far, as token ids, never re-tokenised
    assert policy.contexts == [prompt, prompt + want[: len(first) + len(reply)]]
    assert [lp for lp, mine in zip(episode.logprobs, episode.from_policy, strict=True)
            if not mine] == [0.0] * len(reply)  # fmt: skip
    assert (episode.turns, episode.tool_calls, episode.finish_reason) == (2, 1, "stop")
    assert episode.policy_version == 3


def test_the_token_budget_and_the_turn_limit_end_an_episode():
    call = "<tool>calculator: 1/0</tool>"
    cut = run_episode(ScriptedPolicy([call, "x" * 50]), ToolEnvironment(), encode, [1],
                      max_turns=4, max_tokens=len(call) + 5)  # fmt: skip
    assert len(cut.token_ids) == len(call) + 5 and cut.finish_reason == "length"
    assert cut.tool_errors == 1  # division by zero, read back as a message
    loop = run_episode(ScriptedPolicy([call] * 2), ToolEnvironment(), encode, [1],
                       max_turns=2, max_tokens=500)  # fmt: skip
    assert loop.finish_reason == "turns" and loop.tool_calls == 2


@pytest.mark.parametrize("loss", ["grpo", "cagrpo"])
def test_environment_tokens_carry_no_loss_and_no_kernel_statistics(loss):
    """The same responses with environment tokens spliced in (mask 0, arbitrary log-probs)
    give the loss of the responses alone, and no gradient at the environment's positions:
    the kernel's group statistics run over policy tokens only."""
    g = torch.Generator().manual_seed(random.randrange(2**31))
    rows, width, groups = 8, 12, 2
    new = torch.randn(rows, width, generator=g) * 0.3 - 1.0
    old = new.detach() + torch.randn(rows, width, generator=g) * 0.05
    advantages = torch.randn(rows, generator=g)
    group_ids = torch.arange(groups).repeat_interleave(rows // groups)
    lengths = torch.randint(4, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    # splice 5 environment tokens into each row at a random place
    env_len, spliced = 5, width + 5
    old_lp = torch.randn(rows, spliced, generator=g)  # garbage where the environment spoke
    smask = torch.zeros(rows, spliced, dtype=torch.bool)
    env_at = torch.zeros(rows, spliced, dtype=torch.bool)
    columns = []
    for r in range(rows):
        cut = int(torch.randint(1, int(lengths[r]), (1,), generator=g))
        keep = list(range(cut)) + list(range(cut + env_len, spliced))
        columns.append(keep[:width])
        env_at[r, cut : cut + env_len] = True
    leaf = new.clone().requires_grad_(True)
    spliced_lp = torch.randn(rows, spliced, generator=g).requires_grad_(True)
    for r in range(rows):
        index = torch.tensor(columns[r])
        old_lp[r, index] = old[r]
        smask[r, index] = mask[r]
    with torch.no_grad():  # the policy positions carry the same values as the compact rows
        for r in range(rows):
            spliced_lp[r, torch.tensor(columns[r])] = new[r]
    compact = policy_loss(loss, leaf, old, advantages, mask, group_ids).loss
    with_env = policy_loss(loss, spliced_lp, old_lp, advantages, smask, group_ids).loss
    assert with_env.item() == pytest.approx(compact.item(), rel=1e-6, abs=1e-7)
    with_env.backward()
    compact.backward()
    assert torch.all(spliced_lp.grad[env_at] == 0)  # exactly: no loss at the environment
    for r in range(rows):
        torch.testing.assert_close(spliced_lp.grad[r, torch.tensor(columns[r])], leaf.grad[r])


class BatchScript:
    """Stands in for an engine's batch `generate` in this unit of `run_episodes`: sample j of
    prompt p says `script[(p[0], j)][turn]`; records every call. A later turn's context is
    told by its prompt and its first turn (unique in the script below)."""

    def __init__(self, script: dict, later_version: int):
        self.script, self.calls, self.later_version = script, [], later_version

    def __call__(self, prompts, sampling):
        self.calls.append((prompts, sampling))
        first = len(self.calls) == 1
        groups = []
        for prompt in prompts:
            if first:
                texts = [self.script[(prompt[0], j)][0] for j in range(sampling.n)]
            else:
                turns = next(t for (p, _), t in self.script.items() if p == prompt[0]
                             and _chars(prompt[2:]).startswith(t[0]))  # fmt: skip
                texts = [turns[_chars(prompt).count("<result>")]]
            group = []
            for text in texts:
                tokens = [ord(c) for c in text][: sampling.max_tokens]
                finish = "stop" if len(tokens) == len(text) else "length"
                version = 0 if first else self.later_version
                group.append(Completion(list(prompt), tokens, [-0.5] * len(tokens),
                                        text[: len(tokens)], finish, version))  # fmt: skip
            groups.append(group)
        return groups


def _chars(tokens) -> str:
    return "".join(chr(t - 1000 if t >= 1000 else t) for t in tokens)


def test_run_episodes_samples_first_turns_in_one_request_and_goes_on_alone():
    from dataclasses import replace

    from cagrpo_ray.env import run_episodes
    from cagrpo_ray.types import SamplingConfig

    call = "<tool>calculator: 6*7</tool>"
    script = {(7, 0): ["done 1"], (7, 1): [call, "it is 42"],
              (8, 0): ["x" + call, call, "ok"], (8, 1): ["done 2"]}  # fmt: skip
    engine = BatchScript(script, later_version=5)
    prompts = [[7, 0], [8, 0]]
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=120, seed=9)
    episodes = run_episodes(engine, ToolEnvironment(), encode, prompts, sampling, max_turns=4)
    first_prompts, first_sampling = engine.calls[0]
    assert first_prompts == prompts and first_sampling == replace(sampling, stop=("</tool>",))
    # an episode whose first turn called no tool is the first request's sample as it was
    lone = episodes[0][0]
    assert (lone.token_ids, lone.from_policy, lone.turns) == ([ord(c) for c in "done 1"], None, 1)
    later = engine.calls[1:]
    assert len(later) == 3 and all(len(p) == 1 and s.n == 1 for p, s in later)
    seeds = [s.seed for _, s in later]
    assert len(set(seeds)) == len(seeds) and sampling.seed not in seeds
    for (context,), s in later:  # every budget is the episode's room
        assert s.max_tokens == sampling.max_tokens - (len(context) - 2)
    going_on = episodes[0][1]
    reply = encode("<result>42</result>")
    assert going_on.token_ids == [ord(c) for c in call] + reply + [ord(c) for c in "it is 42"]
    assert going_on.from_policy == [True] * len(call) + [False] * len(reply) + [True] * 8
    assert going_on.logprobs == [-0.5] * len(call) + [0.0] * len(reply) + [-0.5] * 8
    assert going_on.text == call + "<result>42</result>it is 42"
    # the first turn was sampled by version 0, the next by 5: the oldest token counts, and the
    # load sits at version 5's first token
    assert going_on.policy_version == 0 and going_on.loads == [(len(call) + len(reply), 5)]
    assert (episodes[1][0].turns, episodes[1][0].tool_calls, episodes[1][0].finish_reason) == (
        3, 2, "stop")  # fmt: skip
    assert episodes[1][1].from_policy is None


def test_a_single_turn_task_is_the_one_turn_episode_sample_for_sample():
    """Single-turn runs go through the same episode loop: the samples come back as the
    engine gave them (tokens, log-probs, text, finish reason, version, loads)."""
    from cagrpo_ray.env import run_episodes
    from cagrpo_ray.env.episode import SINGLE_TURN
    from cagrpo_ray.types import SamplingConfig

    rng = random.Random()
    groups = []
    for p in range(3):
        group = []
        for _ in range(4):
            n = rng.randint(0, 9)
            tokens = [rng.randrange(300) for _ in range(n)]
            # a load mid-way, or before the first token (in-flight weight updates)
            loads = [(rng.randint(0, n - 1), 7)] if n > 2 and rng.random() < 0.5 else []
            group.append(Completion([p], tokens, [-rng.random() for _ in tokens],
                                    "".join(map(chr, tokens)), rng.choice(["stop", "length"]),
                                    5, loads=loads))  # fmt: skip
        groups.append(group)
    sampling = SamplingConfig(n=4, max_tokens=9, seed=3)
    calls = []

    def engine(prompts, s):
        calls.append(s)
        return groups

    played = run_episodes(engine, SINGLE_TURN, encode, [[0], [1], [2]], sampling, max_turns=1)
    assert calls == [sampling]  # one request, asked exactly as a single-turn batch
    assert all(a is b for pa, pb in zip(played, groups, strict=True)
               for a, b in zip(pa, pb, strict=True))  # fmt: skip
