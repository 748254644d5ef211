"""`python -m cagrpo_ray.run` with bad input: one clear line and exit status 2, no traceback,
nothing started that outlives the error; the short report a finished run prints; and the
checkpoint `--resume auto` continues from (tests/test_run_exits.py runs it end to end)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cagrpo_ray.api import final_report
from cagrpo_ray.policies.model import random_policy

TINY = dict(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64)


def run_cli(*overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", "configs/cpu-tiny.yaml"]
    for item in ("metrics.enabled=false", "run.ray_num_cpus=3", *overrides):
        command += ["--set", item]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_a_malformed_data_row_is_one_line_naming_file_and_row(tmp_path):
    policy = random_policy(tmp_path / "policy", seed=0, **TINY)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"problem": "1+1=", "answer": "2"}\n{"problem": "2+2=", "answer": 4}\n')
    result = run_cli(
        f"model.path={policy}",
        "data.source=file",
        f"data.path={data}",
        f"data.eval_path={data}",
        "data.on_bad_row=error",
        f"run.output_dir={tmp_path / 'runs'}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error: {data}, line 2: answer 'answer' is int, not str"


@pytest.mark.integration
def test_a_model_path_that_is_nothing_is_one_line(tmp_path):
    result = run_cli("model.path=/no/such/model", f"run.output_dir={tmp_path}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model path '/no/such/model' is not a folder here")


@pytest.mark.unit
def test_the_final_report_is_a_short_table_with_the_paths():
    summary = {
        "eval_before": {"samples": 4, "pass@1": 0.25, "pass@4": 0.5, "maj@4": 0.3,
                        "mean_response_tokens": 20.0, "mean_sampled_token_nll": 0.1,
                        "per_prompt": [{"uid": str(i)} for i in range(200)]},
        "eval_after": {"samples": 4, "pass@1": 0.35, "pass@4": 0.6, "maj@4": 0.4,
                       "mean_response_tokens": 18.0, "mean_sampled_token_nll": 0.08},
        "time/step": {"mean": 2.2},
        "final_step": 40,
        "run_dir": "runs/cpu-tiny",
        "policy_dir": "runs/cpu-tiny/policy",
    }  # fmt: skip
    report = final_report(summary)
    lines = report.splitlines()
    assert len(lines) < 20  # not 200 per-prompt entries
    assert "pass@1" in lines[1] and "0.250" in lines[1] and "0.350" in lines[1]
    assert any(line.startswith("pass@4") and "0.600" in line for line in lines)
    assert any(line.startswith("maj@4") for line in lines)
    assert "2.20" in report and "runs/cpu-tiny/plots/" in report
    assert "python -m cagrpo_ray.eval --model runs/cpu-tiny/policy" in report

    one = {
        key: {"samples": 1, "pass@1": 0.5, "maj@1": 0.5} for key in ("eval_before", "eval_after")
    }
    rows = [line.split()[0] for line in final_report(one).splitlines()[1:4]]
    assert rows == ["pass@1", "maj@1", "mean"]  # one sample: pass@1 once


class _Learners:
    def __init__(self):
        self.loaded: list[str] = []

    def load_checkpoint(self, path: str) -> None:
        self.loaded.append(path)


class _Loop:
    step = 0

    def load(self, path) -> None:
        self.step = json.loads((path / "trainer_state.json").read_text())["step"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "written, damaged, expected",
    [((), None, None), ((2,), None, 2), ((2, 4), 4, 2)],
    ids=["fresh-directory", "one-checkpoint", "corrupt-latest"],
)
def test_resume_auto_continues_from_the_newest_checkpoint_that_verifies_else_starts_fresh(
    tmp_path, written, damaged, expected
):
    """What `--resume auto` makes the trainer load: nothing in a run directory without a
    checkpoint (the run starts at step 0), else the newest checkpoint that verifies."""
    from cagrpo_ray.checkpoints import write_checkpoint
    from cagrpo_ray.config import load_config
    from cagrpo_ray.driver.trainer import Trainer

    config = load_config("configs/cpu-tiny.yaml", [f"run.output_dir={tmp_path}", "run.name=r"])
    trainer = Trainer(config, resume=True)
    for step in written:
        with write_checkpoint(trainer.ckpt_root, f"step_{step:06d}", keep=5) as path:
            (path / "learner").mkdir()
            (path / "learner" / "model.pt").write_bytes(b"weights" * 100)
            (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    if damaged is not None:  # a write torn by a crash, found by the manifest's size
        model = trainer.ckpt_root / f"step_{damaged:06d}" / "learner" / "model.pt"
        model.write_bytes(model.read_bytes()[:100])
    trainer.learners, trainer.loop = _Learners(), _Loop()
    trainer._load_latest_checkpoint()
    if expected is None:
        assert trainer.step == 0 and trainer.learners.loaded == []
    else:
        assert trainer.step == expected
        assert trainer.learners.loaded == [str(trainer.ckpt_root / f"step_{expected:06d}/learner")]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("error", "status", "traceback"),
    [
        ("cagrpo_ray.rewards.custom:RewardFunctionError", 2, False),
        ("cagrpo_ray.placement:PlacementError", 2, False),
        ("cagrpo_ray.schedule:DynamicSamplingError", 1, False),
        ("cagrpo_ray.learner.restarts:LearnerLostError", 1, False),
        ("builtins:RuntimeError", 1, True),
    ],
)
def test_the_exit_status_and_the_output_follow_the_errors_class(
    tmp_path, monkeypatch, capsys, error, status, traceback
):
    """Bad input (`errors.UserError`) is one line and status 2; a run stopped with its
    checkpoint intact (`errors.StoppedWithCheckpoint`) one line and status 1; anything else
    its traceback and status 1."""
    import importlib

    from cagrpo_ray import api
    from cagrpo_ray.run import main

    module, _, name = error.partition(":")
    raised = getattr(importlib.import_module(module), name)("what went wrong")

    def run_training(config, resume):
        raise raised

    monkeypatch.setattr(api, "run_training", run_training)
    code = main(["--config", "configs/cpu-tiny.yaml", "--set", f"run.output_dir={tmp_path}"])
    stderr = capsys.readouterr().err
    assert code == status
    assert ("Traceback" in stderr) == traceback
    if not traceback:
        assert stderr.strip().splitlines()[-1] == "error: what went wrong"
