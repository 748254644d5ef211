"""Per-step JSONL log, end-of-run plots and summary."""

import math

import pytest

from cagrpo_ray.metrics.jsonl import MetricsLog, read_metrics
from cagrpo_ray.metrics.plots import FIGURES, OPTIONAL_FIGURES, plot_run, summarize

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
