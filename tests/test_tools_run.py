"""Multi-turn episodes with the calculator, end to end on the CPU (`configs/cpu-tools.yaml`):
a small policy warm-started like the `chain_sum_tools` preset on a smaller budget
(`tools_policy`: it calls the tool, not always well), a vLLM generator, 2 DeepSpeed ranks, real
Ray, the asynchronous schedule (bound 1, so episodes are in flight at every checkpoint).

One run of 4 steps, then a second run that resumes from its step-2 checkpoint to step 4:

- every environment segment the learner got is the calculator's reply to the policy's turn
  before it, encoded (token in, token out, turn by turn, at the system level; the log-probs
  of each turn against a forward pass are `tests/test_env.py`'s, on both engines);
- the learner trained on the policy's tokens only (`learner/tokens` per step is the count of
  policy tokens of the step's batch), and the env metrics count the calls;
- no sample staler than the bound, counted by an episode's oldest token;
- the resumed run trains no prompt the first run trained before its checkpoint, none twice:
  episodes in flight at the checkpoint are generated again, whole, after the resume;
- the held-out evaluation reports tool use, and the token inspector shows the tool results
  apart from the policy's tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_train import RecordingTrainer, resume_from
from transformers import AutoTokenizer

from cagrpo_ray.config import load_config
from cagrpo_ray.env import ToolEnvironment
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.policies.build import PRESETS, ensure_policy

pytestmark = [pytest.mark.integration, pytest.mark.preset]

CONFIG = "configs/cpu-tools.yaml"
STEPS, RESUME_AT, PROMPTS, GROUP = 4, 2, 8, 8
# The preset's warm start, cut short: 150 steps of 16 examples (the preset's steps have 64),
# and 64 held-out prompts for its build_info (256). A build takes about a quarter of the
# 150 x 64 one (271 s on an idle 2-core machine), and its policy calls the calculator in 23 of
# 64 sampled held-out responses (the 150 x 64 one: 31; 100 x 16: 20, with 9 well-formed).
SFT_STEPS, SFT_BATCH, SFT_EVAL = 150, 16, 64


def tools_policy():
    spec = PRESETS["chain_sum_tools"].with_budget(SFT_STEPS)
    return ensure_policy(dataclasses.replace(spec, batch_size=SFT_BATCH, eval_size=SFT_EVAL))


def overrides(tmp_path, name, policy, steps=STEPS):
    return [
        f"model.path={policy}",
        "rollout.num_generators=1",
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        f"run.steps={steps}",
        "run.max_staleness=1",
        f"run.checkpoint_every={RESUME_AT}",
        "run.keep_checkpoints=2",
        "rollout.enforce_eager=true",
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.group_size={GROUP}",
        "data.eval_size=16",
        "eval.samples=2",
        "eval.temperatures=[]",
        "metrics.port=0",
        f"metrics.inspect_every={RESUME_AT}",
        "metrics.inspect_groups=2",
        "sync.timeout_s=20",
    ]


class TableTrainer(RecordingTrainer):
    """Also keeps every batch the learner trained on, as the buffer gave it."""

    def setup(self):
        super().setup()
        self.tables = []
        take = self.loop.schedule.buffer.take_ids

        def keeping_take(*args, **kwargs):
            table = take(*args, **kwargs)
            self.tables.append(table)
            return table

        self.loop.schedule.buffer.take_ids = keeping_take


@pytest.fixture(scope="module")
def tools_runs(tmp_path_factory, shared_ray, kept_generators):
    policy = tools_policy()
    tmp_path = tmp_path_factory.mktemp("tools")
    config = load_config(CONFIG, overrides(tmp_path, "first", policy))
    first = TableTrainer(config, kept=kept_generators)
    first_summary = first.run()
    resume_from(tmp_path / "first", tmp_path / "resumed", RESUME_AT)
    config = load_config(CONFIG, overrides(tmp_path, "resumed", policy))
    resumed = TableTrainer(config, resume=True, kept=kept_generators)  # the first's replicas
    resumed_summary = resumed.run()
    return tmp_path, (first, first_summary), (resumed, resumed_summary)


def segments(tokens, mask):
    """(by the policy, tokens) runs of a response, in order."""
    out, start = [], 0
    for t in range(1, len(tokens) + 1):
        if t == len(tokens) or mask[t] != mask[start]:
            out.append((mask[start], tokens[start:t]))
            start = t
    return out


def test_the_learner_got_the_sampled_turns_and_the_calculators_replies(tools_runs):
    tmp_path, (first, _), (resumed, _) = tools_runs
    tokenizer = AutoTokenizer.from_pretrained(first.model_path)
    env = ToolEnvironment(("calculator",))
    replies = calls = 0
    for table in first.tables + resumed.tables:
        masks = table.column("policy_mask").to_pylist()
        responses = table.column("response_token_ids").to_pylist()
        for tokens, mask in zip(responses, masks, strict=True):
            if mask is None:
                continue
            parts = segments(tokens, mask)
            assert parts[0][0], "an episode starts with the policy's turn"
            for (by_policy, part), (_, before) in zip(parts[1:], parts, strict=False):
                if by_policy:
                    continue
                reply = env.reply(tokenizer.decode(before))
                assert not reply.done
                encoded = tokenizer.encode(reply.text, add_special_tokens=False)
                assert part == encoded[: len(part)]
                replies += 1
        calls += int(np.sum(table.column("tool_calls").to_numpy()))
    assert replies > 0, "no trained episode called the calculator"
    assert replies <= calls


def test_only_policy_tokens_were_trained_and_the_env_metrics_count_the_calls(tools_runs):
    tmp_path, (first, _), _ = tools_runs
    records = {r["step"]: r for r in read_metrics(tmp_path / "first" / "metrics.jsonl")}
    assert sorted(records) == list(range(1, STEPS + 1))
    for step, table in enumerate(first.tables, start=1):
        masks = table.column("policy_mask").to_pylist()
        lengths = table.column("response_len").to_pylist()
        policy_tokens = sum(n if m is None else sum(m) for m, n in zip(masks, lengths, strict=True))
        record = records[step]
        assert record["learner/tokens"] == policy_tokens
        assert record["env/tool_calls"] == int(np.sum(table.column("tool_calls").to_numpy()))
        env_tokens = sum(0 if m is None else len(m) - sum(m) for m in masks)
        assert record["env/environment_token_fraction"] == pytest.approx(
            env_tokens / sum(lengths), abs=1e-9
        )
        assert 1.0 <= record["env/turns_mean"] <= 3.0
        assert record["staleness/max"] <= 1
    assert any(records[s]["env/tool_calls"] > 0 for s in records)


def test_a_resume_trains_no_episode_twice_and_loses_none(tools_runs):
    tmp_path, (first, _), (resumed, summary) = tools_runs
    assert summary["final_step"] == STEPS
    before = first.trained_prompts[: RESUME_AT * PROMPTS]
    after = resumed.trained_prompts
    assert len(after) == (STEPS - RESUME_AT) * PROMPTS
    assert len(set(after)) == len(after)
    assert not set(before) & set(after)
    # group ids go on from the checkpoint without a gap: in-flight episodes were requeued
    groups = resumed.trained_groups
    assert min(groups) >= RESUME_AT * PROMPTS - 2 * PROMPTS  # at most the bound's chunks back
    assert len(set(groups)) == len(groups)


def test_the_evaluation_reports_tool_use_and_the_inspector_shows_tool_results(tools_runs):
    from cagrpo_ray.inspect import read_step, render_page

    tmp_path, (_, summary), _ = tools_runs
    for when in ("eval_before", "eval_after"):
        result = summary[when]
        assert 0.0 <= result["tool_call_fraction"] <= 1.0
        assert result["mean_tool_calls"] >= result["tool_call_fraction"]
    table, metadata = read_step(tmp_path / "first")
    rows = [r for r in table.to_pylist() if r["environment"]]
    if rows:  # the inspected groups held an episode that called the tool
        page = render_page(table, metadata, [metadata["step"]])
        assert page.count("<em class=env") == sum(len(r["environment"]) for r in rows)
        assert all("<result>" in seg["text"] for r in rows for seg in r["environment"])


def test_the_evaluation_cli_plays_episodes_with_the_calculator(tmp_path):
    import json
    import subprocess
    import sys

    policy = tools_policy()
    out = tmp_path / "results.json"
    data = "reasoning_gym:chain_sum?seed=5&size=8&min_terms=3&max_terms=4&min_digits=2&max_digits=3"
    command = [sys.executable, "-m", "cagrpo_ray.eval", "--model", str(policy), "--data", data,
               "--samples", "4", "--engine", "hf", "--max-tokens", "96", "--instruction", "none",
               "--max-turns", "3", "--tools", "calculator", "--out", str(out)]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["tool_call_fraction"] > 0, "the warm-started policy called no tool"
    assert metrics["mean_tool_calls"] >= metrics["tool_call_fraction"]
    assert "tool_call_fraction" in finished.stdout
