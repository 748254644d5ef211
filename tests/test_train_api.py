"""`from cagrpo_ray import train` end to end on the CPU: a short run of the default config with
every tracker on (W&B offline, MLflow's local file store, TensorBoard), through the same Ray,
vLLM and DeepSpeed path as `make train`. The returned run directory and evaluation are the
run's own (summary.json), and what each tracker holds, read back with its own library, equals
metrics.jsonl and the final table."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from cagrpo_ray import TrainResult, train
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.metrics.trackers import finite_scalars, mlflow_key, summary_values
from tests.tracker_readers import read_mlflow, read_tensorboard, read_wandb

pytestmark = pytest.mark.integration

STEPS = 2


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a local cluster, started and ended


def test_train_returns_the_run_and_the_trackers_hold_its_metrics(tmp_path, offline):
    result = train(
        "configs/cpu-tiny.yaml",
        overrides={
            "run.output_dir": tmp_path,
            "run.name": "api",
            "run.steps": STEPS,
            "run.checkpoint_every": 0,  # the final checkpoint only
            "rollout.prompts_per_step": 8,
            "rollout.enforce_eager": True,  # the engines start in half the time
            "data.eval_size": 8,
            "eval.samples": 2,
            "metrics.port": 0,
            "metrics.inspect_every": 0,
            "metrics.loggers": ["wandb", "mlflow", "tensorboard"],
        },
    )
    assert isinstance(result, TrainResult)
    run_dir = tmp_path / "api"
    assert result.run_dir == run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert result.summary == summary and summary["final_step"] == STEPS
    for evaluation in (result.eval_before, result.eval_after):
        assert evaluation["samples"] == 2 and 0 <= evaluation["pass@1"] <= 1
    assert result.eval_before == summary["eval_before"]
    assert result.eval_after == summary["eval_after"]
    assert (result.policy_dir / "config.json").exists()
    assert "held-out" in str(result) and str(run_dir) in str(result)  # the CLI's final table

    jsonl = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in jsonl] == list(range(1, STEPS + 1))
    expected = {r["step"]: finite_scalars(r) for r in jsonl}
    assert "reward/mean" in expected[1] and "time/step" in expected[STEPS]
    final = summary_values(summary)
    assert final["eval_after/pass@1"] == result.eval_after["pass@1"]
    params = json.loads((run_dir / "config.json").read_text())

    history, wb_params, wb_summary = read_wandb(run_dir)
    assert history == expected
    assert wb_params["run.steps"] == STEPS == params["run"]["steps"]
    assert {k: wb_summary[k] for k in final} == final

    keys = sorted({mlflow_key(k) for r in expected.values() for k in r})
    history, ml_params, ml_metrics = read_mlflow(run_dir, keys)
    assert history == {s: {mlflow_key(k): v for k, v in r.items()} for s, r in expected.items()}
    assert ml_params["model.path"] == params["model"]["path"]
    assert {k: ml_metrics[mlflow_key(k)] for k in final} == final

    history, tb_params, tb_summary = read_tensorboard(run_dir)
    f32 = {s: {k: float(np.float32(v)) for k, v in r.items()} for s, r in expected.items()}
    assert history == f32
    assert tb_params["rollout.prompts_per_step"] == 8
    assert tb_summary == {k: float(np.float32(v)) for k, v in final.items()}


def test_a_tracker_that_cannot_start_stops_the_command_in_one_line(tmp_path, offline):
    """Before any actor starts: exit status 2, one line naming the tracker, no traceback."""
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", "configs/cpu-tiny.yaml"]
    for item in (
        f"run.output_dir={tmp_path}",
        "metrics.enabled=false",
        "metrics.loggers=[tensorboard, mlflow]",
        "metrics.mlflow_tracking_uri=nosuch://tracker",
    ):
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: metrics.loggers 'mlflow' could not start: "), last
    assert not (tmp_path / "cpu-tiny" / "checkpoints").exists()
