"""benchmarks/gpu_check.py: its CPU smoke run takes every path of the GPU check (learner at
ZeRO-2 and ZeRO-3, the sync's refusal and bit-for-bit transfer, the memory probe) at tiny sizes
and writes both reports; the run on a GPU itself is not part of the suite."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_only_wheels_of_missing_or_older_projects_are_installed(tmp_path):
    for name in (
        "deepspeed-0.19.8-py3-none-any.whl",  # installed here, at that version
        "pytest-1.0-py3-none-any.whl",  # installed here, newer
        "not_installed_xyz-0.1-cp311-cp311-manylinux2014_x86_64.whl",
        "not_installed_xyz-0.1-cp312-cp312-manylinux2014_x86_64.whl",  # pip picks one
    ):
        (tmp_path / name).touch()
    assert gpu_check_module().wheels_to_install(tmp_path) == ["not_installed_xyz==0.1"]


@pytest.mark.integration
def test_the_cpu_smoke_run_passes_every_check(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["mode"] == "cpu"

    for stage in ("zero2", "zero3"):
        case = report["learner"][stage]
        assert case["passed"], case
        assert len(case["steps"]) == 3
        for step in case["steps"]:
            assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
        assert case["planner"]["total_gib"] > 0  # the planner imports here

    sync = report["sync"]
    assert sync["ipc"].startswith("not implemented")
    refusal = sync["refusal"]
    assert refusal["passed"]
    assert "same GPU" in refusal["learner_error"] and "same GPU" in refusal["receiver_error"]
    gloo = sync["gloo"]
    assert gloo["passed"] and len(gloo["versions"]) == 3
    for version in gloo["versions"]:
        assert version["tensors"] > 0 and version["differing_tensors"] == []
        assert version["changed_since_previous"]
    assert "skipped" in sync["nccl"]

    memory = report["memory"]
    assert memory["passed"]
    for case in ("checkpointing", "no_checkpointing"):
        assert math.isfinite(memory[case]["loss"])
        assert memory["planner"][case]["peak_above_weights_gib"] >= 0

    checks = {c["check"]: c["passed"] for c in report["checks"]}
    assert checks["learner zero2"] and checks["learner zero3"] and checks["memory probe"]
    assert checks["sync refusal on one GPU"] and checks["sync gloo"]
    assert checks["sync nccl"] is None and checks["sync CUDA IPC"] is None
    table = (tmp_path / "gpu_check.md").read_text()
    for name in checks:
        assert f"| {name} |" in table
