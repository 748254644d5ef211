"""`experiments/study4_eval.py` run for real, as round 4 runs it: in round 3's pinned snapshot
of the package, on a few prompts of the second test split, with a random tiny policy on the
HF engine. Its unit tests (tests/test_study4_plan.py) feed the recorder fake evaluations; this
one checks that the script finds and wraps the pinned evaluation and that the samples it keeps
are the ones the evaluation scored."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments"))
import study  # noqa: E402
import study4  # noqa: E402

PROMPTS, SAMPLES = 6, 2


def in_history(commit: str) -> bool:
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO)
    return found.returncode == 0


def test_the_kept_samples_are_the_ones_the_pinned_evaluation_scored(tmp_path):
    from cagrpo_ray.policies.model import random_policy

    out = tmp_path / "out"
    out.mkdir()
    pinned = study4.ROUND3_ARCHIVE / "SOURCE_COMMIT"
    if in_history(pinned.read_text().strip()):
        shutil.copy2(pinned, out / "SOURCE_COMMIT")
        _, src = study.pinned_source(out)  # what study4.py evaluates with
    else:  # a shallow clone: today's package, which re-exports `evaluate` the same way
        src = REPO
    model = random_policy(tmp_path / "policy", seed=0)
    stem = tmp_path / "test2"
    command = [
        sys.executable, str(REPO / "experiments/study4_eval.py"),
        "--samples-out", f"{stem}.samples.jsonl.gz", "--",
        "--model", str(model), "--engine", "hf",
        "--data", str(study4.TEST2_FILE), "--question-column", "question",
        "--limit", str(PROMPTS), "--samples", str(SAMPLES), "--temperature", "0.7",
        "--max-tokens", "16", "--seed", "0", "--out", f"{stem}.json",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    done = subprocess.run(command, cwd=src, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"cagrpo_ray from {src.resolve()}" in done.stdout  # the package it was given

    metrics = json.loads(Path(f"{stem}.json").read_text())["metrics"]
    with gzip.open(f"{stem}.samples.jsonl.gz", "rt") as handle:
        kept = [json.loads(line) for line in handle]
    questions = [json.loads(line) for line in study4.TEST2_FILE.read_text().splitlines()]
    assert len(kept) == PROMPTS * SAMPLES == metrics["num_prompts"] * metrics["samples"]
    assert {s["stratum"] for s in kept} <= {"plain", "negated", "parenthesised"}
    assert [s["stratum"] for s in kept[::SAMPLES]] == [q["stratum"] for q in questions[:PROMPTS]]
    assert all(0 < s["response_tokens"] <= 16 for s in kept)
    assert all(s["truncated"] == (s["finish_reason"] == "length") for s in kept)
    correct = sum(s["correct"] for s in kept) / len(kept)
    assert correct == pytest.approx(metrics["pass@1"])
    tokens = sum(s["response_tokens"] for s in kept) / len(kept)
    assert tokens == pytest.approx(metrics["mean_response_tokens"])
