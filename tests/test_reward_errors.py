"""Reward errors a user can read (`rewards/errors.py`): the first of each kind on the console
with its function, sample and message, a count every N steps, and every one with its sample
in the run's `logs/reward_errors.jsonl`; and the Ray loop reporting each scored response's
error with the sample it was for (`TrainingLoop._on_scored`)."""

from __future__ import annotations

import json
import logging

import pytest

from cagrpo_ray.config import load_config
from cagrpo_ray.data.types import PromptItem
from cagrpo_ray.driver.loop import TrainingLoop
from cagrpo_ray.rewards.errors import RewardErrorLog, error_kind
from cagrpo_ray.rewards.function import RewardResult
from cagrpo_ray.types import Completion

pytestmark = pytest.mark.unit

RAISED = "reward function 'strict' on sample 'data.jsonl:{row}' raised ValueError: bad row {row}"


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_first_error_of_each_kind_is_shown_and_every_error_is_kept(tmp_path, caplog):
    path = tmp_path / "logs" / "reward_errors.jsonl"
    errors = RewardErrorLog(path, report_every=2)
    with caplog.at_level(logging.WARNING, logger="cagrpo_ray"):
        errors.record(1, RAISED.format(row=17), "data.jsonl:17", 17, 4, 1, "answer: x")
        errors.record(1, RAISED.format(row=23), "data.jsonl:23", 23, 5, 0, "answer: y")
        errors.record(1, "math timed out after 5 s", "data.jsonl:3", 3, 6, 2, "...")
    shown = [r.getMessage() for r in caplog.records]
    assert len(shown) == 2  # row 23's error is row 17's kind: not shown again
    assert "on sample 'data.jsonl:17' (training prompt 17, group 4, response 1)" in shown[0]
    assert "reward function 'strict' raised ValueError: bad row 17" in shown[0]
    assert str(path) in shown[0]
    assert "math timed out after 5 s" in shown[1]
    kept = read(path)
    assert [e["uid"] for e in kept] == ["data.jsonl:17", "data.jsonl:23", "data.jsonl:3"]
    assert kept[0] == {
        "step": 1, "uid": "data.jsonl:17", "prompt_index": 17, "group_id": 4,
        "response_index": 1, "error": RAISED.format(row=17), "response": "answer: x",
    }  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cagrpo_ray"):
        errors.step_done(1)  # not yet: every 2 steps
        errors.step_done(2)
        errors.step_done(4)  # no error since: nothing to say
    (count,) = [r.getMessage() for r in caplog.records]
    assert count.startswith("reward errors: 3 in steps 1-2 (2 kinds; 3 in the run)")


def test_an_errors_kind_ignores_the_sample_and_the_numbers():
    assert error_kind(RAISED.format(row=1)) == error_kind(RAISED.format(row=2000))
    assert error_kind(RAISED.format(row=1)) != error_kind("math timed out after 5 s")


def test_the_loop_reports_each_scored_responses_error_with_its_sample(tmp_path):
    config = load_config("configs/cpu-tiny.yaml", ["rollout.group_size=2"])
    source = [PromptItem(f"data.jsonl:{i}", f"q{i}", "1") for i in range(8)]
    errors = RewardErrorLog(tmp_path / "reward_errors.jsonl")
    loop = TrainingLoop(config, None, source, None, None, None, None, None, reward_errors=errors)
    start = loop.schedule.start_chunk(2, 0)
    groups = [
        [Completion([1], [2, 3], [-0.1, -0.2], f"text {p}.{k}", "stop", 0) for k in range(2)]
        for p in range(2)
    ]
    failed = RAISED.format(row=1)
    results = [RewardResult(1.0, True, {}), RewardResult(0.0, False, {}),
               RewardResult(1.0, True, {}), RewardResult(0.0, False, {}, error=failed)]  # fmt: skip
    loop.reward_refs["ref"] = (start.chunk, groups)
    loop._wait = lambda refs, what: [results]
    loop._on_scored("ref")
    assert loop.verifier_errors == 1
    (kept,) = read(tmp_path / "reward_errors.jsonl")
    assert (kept["uid"], kept["prompt_index"], kept["group_id"], kept["response_index"]) == (
        "data.jsonl:1", 1, start.chunk.group_ids[1], 1,
    )  # fmt: skip
    assert (kept["step"], kept["error"], kept["response"]) == (1, failed, "text 1.1")
