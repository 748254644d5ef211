"""Per-step JSONL log, end-of-run plots and summary."""

import math
import random

import numpy as np
import pytest

from cagrpo_ray.metrics.jsonl import MetricsLog, read_metrics
from cagrpo_ray.metrics.plots import (
    FIGURES,
    OPTIONAL_FIGURES,
    SMOOTH_WINDOW,
    held_out_marks,
    moving_average,
    plot_run,
    summarize,
)

pytestmark = pytest.mark.unit


def test_jsonl_roundtrip_nan_and_truncate(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    for step in range(1, 6):
        log.write({"step": step, "reward/mean": step / 10, "policy/entropy": math.nan})
    records = read_metrics(log.path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["policy/entropy"] is None  # JSON has no NaN; the key stays visible
    log.truncate_after(3)
    assert [r["step"] for r in read_metrics(log.path)] == [1, 2, 3]
    with pytest.raises(ValueError, match="step"):
        log.write({"reward/mean": 1.0})


def test_plots_are_written_for_every_figure(tmp_path):
    records = [
        {
            "step": s,
            "reward/mean": s * 0.1,
            "policy/entropy": 1.0 / s,
            "cov/q0.01": -s,
            "cagrpo/weight_min": 0.5,
            "throughput/generated_tokens_per_s": 1000.0 + s,
        }
        for s in range(1, 11)
    ]
    paths = plot_run(records, tmp_path / "plots")
    assert sorted(p.stem for p in paths) == sorted(set(FIGURES) - OPTIONAL_FIGURES)
    for record in records:  # a multi-turn run's log
        record["env/tool_calls_per_episode"] = 0.5
    paths = plot_run(records, tmp_path / "plots")
    assert sorted(p.stem for p in paths) == sorted(FIGURES)
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_statistics():
    records = [{"step": 1, "a": 3.0}, {"step": 2, "a": 1.0}, {"step": 3, "a": None}]
    summary = summarize(records, {"extra": 1})
    assert summary["a"] == {"first": 3.0, "last": 1.0, "min": 1.0, "max": 3.0, "mean": 2.0}
    assert summary["extra"] == 1 and summary["steps"] == 3


@pytest.mark.parametrize("seed", range(4))
def test_moving_average_against_a_float64_reference(seed):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=int(rng.integers(1, 40))).tolist()
    window = int(rng.choice([1, 3, 5, SMOOTH_WINDOW]))
    half = window // 2
    # independent: sums over a zero-padded series, divided by how many real values each held
    padded = np.concatenate([np.zeros(half), values, np.zeros(half)])
    counts = np.concatenate([np.zeros(half), np.ones(len(values)), np.zeros(half)])
    kernel = np.ones(window)
    expected = np.convolve(padded, kernel, "valid") / np.convolve(counts, kernel, "valid")
    np.testing.assert_allclose(moving_average(values, window), expected, rtol=1e-12)


def test_held_out_marks_with_their_standard_error():
    rng = random.Random(3)
    samples, n = 4, 50
    per_prompt = [{"num_correct": rng.randint(0, samples)} for _ in range(n)]
    rates = np.array([p["num_correct"] / samples for p in per_prompt])
    summary = {
        "eval_before": {"pass@1": 0.25, "samples": samples, "per_prompt": per_prompt},
        "eval_after": {"pass@1": float(rates.mean()), "samples": samples},  # no per-prompt
        "final_step": 30,
    }
    (before, after) = held_out_marks(summary)
    assert before[:3] == ("before", 0, 0.25)
    assert before[3] == pytest.approx(rates.std(ddof=1) / math.sqrt(n), rel=1e-12)
    assert after == ("after", 30, float(rates.mean()), None)
    assert held_out_marks(None) == [] and held_out_marks({"final_step": 3}) == []


def test_reward_plot_with_the_held_out_evaluations(tmp_path):
    records = [{"step": s, "reward/mean": 0.1 + 0.01 * s, "eval/pass@1": 0.3} for s in range(1, 21)]
    summary = {
        "eval_before": {"pass@1": 0.2, "samples": 2, "per_prompt": [{"num_correct": 1}] * 3},
        "eval_after": {"pass@1": 0.4},
        "final_step": 20,
    }
    paths = plot_run(records, tmp_path, summary)
    assert (tmp_path / "reward.png") in paths
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
