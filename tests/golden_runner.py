"""How the golden recorder and its test run one config (kept apart so the API can change)."""

from __future__ import annotations

from pathlib import Path

from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.metrics.jsonl import read_metrics


def run_one(config, name):
    summary = Trainer(config).run()
    records = read_metrics(Path(config.run.output_dir) / name / "metrics.jsonl")
    return summary, records
