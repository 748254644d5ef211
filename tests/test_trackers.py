"""The trackers of `metrics.loggers` (cagrpo_ray/metrics/trackers.py), each through its real
library, offline: W&B in offline mode, MLflow's local file store, TensorBoard event files.
What each wrote is read back with its own reader (tests/tracker_readers.py) and must equal
metrics.jsonl, the config and the final held-out table."""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import MetricsLog, read_metrics
from cagrpo_ray.metrics.trackers import (
    TrackerError,
    Trackers,
    finite_scalars,
    flatten,
    mlflow_key,
    summary_values,
)
from tests.tracker_readers import read_mlflow, read_tensorboard, read_wandb

pytestmark = pytest.mark.unit

ALL = ["wandb", "mlflow", "tensorboard"]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No tracker may reach the network, nor write outside the test's folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


def config_for(tmp_path, loggers, **sets):
    overrides = [f"run.output_dir={tmp_path}", "run.name=tracked", f"metrics.loggers={loggers}"]
    overrides += [f"{k}={v}" for k, v in sets.items()]
    return load_config("configs/cpu-tiny.yaml", overrides)


def fake_records(steps: int, seed: int) -> list[dict]:
    """Per-step records of the shapes a run writes: rates, nats, seconds, counts, a key MLflow
    must rename (`eval/pass@1`), and a NaN that the JSONL writes as null."""
    rng = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        record = {
            "reward/mean": rng.random(),
            "accuracy/train": rng.random(),
            "entropy/mean": rng.uniform(0.01, 2.0),
            "time/step": rng.uniform(0.1, 100.0),
            "response/length_max": rng.randint(1, 512),
            "cagrpo/weight_min": rng.random() * 1e-9,
        }
        if step % 2 == 0:
            record["eval/pass@1"] = rng.random()
        if step == 2:
            record["policy/kl_step"] = float("nan")
        records.append(record)
    return records


def train_like(config, run_dir, records, summary) -> list[dict]:
    """What Trainer does with a run's records: JSONL, then each tracker; the summary last."""
    log = MetricsLog(run_dir / "metrics.jsonl")
    trackers = Trackers.start(config, run_dir)
    for step, record in enumerate(records, start=1):
        log.write({"step": step, **record})
        trackers.log(step, record)
    assert trackers.finish(summary) == summary  # no tracker failed
    assert trackers.trackers == []  # closed
    return read_metrics(log.path)


SUMMARY = {
    "eval_before": {"pass@1": 0.25, "pass@4": 0.5, "mean_response_tokens": 12.5, "samples": 4},
    "eval_after": {"pass@1": 0.375, "pass@4": 0.625, "mean_response_tokens": 9.0, "samples": 4},
    "final_step": 6,
    "run_dir": "ignored: not a number",
}


def expected_history(jsonl: list[dict]) -> dict[int, dict]:
    return {r["step"]: finite_scalars(r) for r in jsonl}


def test_helpers():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
    }
    assert finite_scalars(
        {"step": 3, "x": 1.5, "y": float("nan"), "z": True, "w": "s", "n": 2}
    ) == {
        "x": 1.5,
        "n": 2,
    }
    assert mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_key("T0.7/maj@4 (x)") == "T0.7/maj_at_4 _x_"
    assert summary_values(SUMMARY) == {
        "eval_before/pass@1": 0.25,
        "eval_before/pass@4": 0.5,
        "eval_before/mean_response_tokens": 12.5,
        "eval_before/samples": 4,
        "eval_after/pass@1": 0.375,
        "eval_after/pass@4": 0.625,
        "eval_after/mean_response_tokens": 9.0,
        "eval_after/samples": 4,
        "final_step": 6,
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_every_tracker_reads_back_what_the_jsonl_holds(tmp_path, seed):
    config = config_for(tmp_path, ALL, **{"algorithm.lr": 3e-5, "rollout.group_size": 6})
    run_dir = tmp_path / "tracked"
    jsonl = train_like(config, run_dir, fake_records(6, seed), SUMMARY)
    assert jsonl[1]["policy/kl_step"] is None  # the NaN: null in the JSONL, absent elsewhere
    expected = expected_history(jsonl)
    params = flatten(config.model_dump(mode="json"))
    final = summary_values(SUMMARY)

    history, wb_params, wb_summary = read_wandb(run_dir)
    assert history == expected  # float64 JSON both ways: exactly equal
    assert wb_params["algorithm.lr"] == 3e-5 and wb_params["rollout.group_size"] == 6
    assert wb_params == params
    for key, value in final.items():
        assert wb_summary[key] == value

    keys = sorted({mlflow_key(k) for r in expected.values() for k in r})
    history, ml_params, ml_metrics = read_mlflow(run_dir, keys)
    renamed = {s: {mlflow_key(k): v for k, v in r.items()} for s, r in expected.items()}
    assert history == renamed
    assert ml_params["algorithm.lr"] == "3e-05" and ml_params == {
        k: str(v) for k, v in params.items()
    }
    for key, value in final.items():  # the last value of a key is what the run shows
        assert ml_metrics[mlflow_key(key)] == value

    history, tb_params, tb_summary = read_tensorboard(run_dir)
    as_f32 = {s: {k: float(np.float32(v)) for k, v in r.items()} for s, r in expected.items()}
    assert history == as_f32  # the event format's scalar is a float32
    assert tb_params["algorithm.lr"] == pytest.approx(3e-5) and tb_params["run.name"] == "tracked"
    assert tb_summary == {k: float(np.float32(v)) for k, v in final.items()}


def test_a_tracker_that_cannot_start_stops_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    config = config_for(tmp_path, ["tensorboard", "wandb"])
    with pytest.raises(
        TrackerError, match=r"metrics.loggers 'wandb'.*pip install -e '\.\[track\]'"
    ):
        Trackers.start(config, tmp_path / "tracked")


def test_a_bad_mlflow_uri_is_named(tmp_path):
    config = config_for(tmp_path, ["mlflow"], **{"metrics.mlflow_tracking_uri": "nosuch://x"})
    with pytest.raises(TrackerError, match="metrics.loggers 'mlflow' could not start"):
        Trackers.start(config, tmp_path / "tracked")


def test_a_tracker_failing_mid_run_is_reported_and_the_others_go_on(tmp_path):
    config = config_for(tmp_path, ["mlflow", "tensorboard"])
    run_dir = tmp_path / "tracked"
    trackers = Trackers.start(config, run_dir)
    mlflow_tracker = trackers.trackers[0]

    def broken(step, scalars):
        raise OSError("disk full")

    mlflow_tracker.log = broken
    records = fake_records(3, 5)
    for step, record in enumerate(records, start=1):
        trackers.log(step, record)
    summary = trackers.finish(SUMMARY)
    assert summary["tracker_errors"] == {"mlflow": "OSError: disk full"}
    history, _, _ = read_tensorboard(run_dir)
    assert sorted(history) == [1, 2, 3]
    assert history[3]["reward/mean"] == pytest.approx(records[2]["reward/mean"], rel=1e-6)


def test_no_logger_no_import(tmp_path):
    """The default config starts no tracker and needs none of the libraries."""
    trackers = Trackers.start(config_for(tmp_path, []), tmp_path / "tracked")
    assert trackers.trackers == []
    assert trackers.finish(SUMMARY) == SUMMARY
    assert list((tmp_path / "tracked").glob("*")) == []  # nothing written
