"""Checkpoints are atomic: a partly written one is never the latest, a truncated or corrupt
latest is reported and the one before it used, and only the newest N are kept."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys

import pytest

from cagrpo_ray.checkpoints import (
    HASH_LIMIT_BYTES,
    LATEST,
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    verify,
    write_checkpoint,
)

pytestmark = pytest.mark.unit


def save(root, step: int, keep: int = 10, payload: bytes = b"weights") -> None:
    """A checkpoint shaped like the trainer's: a learner folder, the state, a buffer."""
    with write_checkpoint(root, f"step_{step:06d}", keep) as path:
        (path / "learner" / "global_step").mkdir(parents=True)
        (path / "learner" / "global_step" / "model.pt").write_bytes(payload * 100)
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
        (path / "buffer.parquet").write_bytes(b"PAR1" + bytes(range(256)) + b"PAR1")


def test_a_written_checkpoint_is_published_whole_and_is_the_latest(tmp_path):
    save(tmp_path, 3)
    path = tmp_path / "step_000003"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / LATEST).read_text() == "step_000003"
    manifest = json.loads((path / MANIFEST).read_text())
    model = manifest["files"]["learner/global_step/model.pt"]
    assert model["bytes"] == 700 and len(model["sha256"]) == 64
    assert set(manifest["files"]) == {
        "learner/global_step/model.pt", "trainer_state.json", "buffer.parquet",
    }  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000003"]  # no leftovers
    assert verify(path) == []


def test_an_error_inside_the_write_leaves_the_previous_checkpoint_the_latest(tmp_path):
    save(tmp_path, 1)
    with pytest.raises(OSError, match="disk full"):
        with write_checkpoint(tmp_path, "step_000002", keep=10) as path:
            (path / "trainer_state.json").write_text("{")
            raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_the_latest(tmp_path):
    save(tmp_path, 1)
    code = (
        "import os, signal, sys\n"
        "from cagrpo_ray.checkpoints import write_checkpoint\n"
        "with write_checkpoint(sys.argv[1], 'step_000002', keep=10) as path:\n"
        "    (path / 'trainer_state.json').write_text('{\"step\": 2}')\n"
        "    (path / 'model.pt').write_bytes(b'half of the wei')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert (tmp_path / ".partial-step_000002").is_dir()  # what the killed write left
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert (tmp_path / LATEST).read_text() == "step_000001"
    save(tmp_path, 3)  # the next write clears the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001", "step_000003"]


@pytest.mark.parametrize(
    "damage, reported",
    [
        (lambda p: (p / "learner/global_step/model.pt").write_bytes(b"weights" * 40),
         "model.pt has 280 bytes, the manifest says 700"),
        (lambda p: (p / "buffer.parquet").write_bytes(b"PAR1" + bytes(255) + b"XPAR1"),
         "buffer.parquet does not match its sha256"),
        (lambda p: (p / "trainer_state.json").unlink(), "trainer_state.json is missing"),
        (lambda p: (p / MANIFEST).unlink(), "MANIFEST.json is missing"),
        (lambda p: (p / MANIFEST).write_text('{"files": '), "MANIFEST.json is unreadable"),
    ],
    ids=["truncated", "corrupt", "missing-file", "missing-manifest", "torn-manifest"],
)
def test_a_damaged_latest_is_reported_and_the_one_before_it_used(
    tmp_path, caplog, damage, reported
):
    save(tmp_path, 1)
    save(tmp_path, 2)
    damage(tmp_path / "step_000002")
    with caplog.at_level(logging.WARNING, logger="cagrpo_ray.checkpoints"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert "step_000002 is incomplete or corrupt, using the one before it" in caplog.text
    assert reported in caplog.text


def test_no_checkpoint_is_none_and_none_that_verifies_is_an_error(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None
    assert latest_checkpoint(tmp_path) is None
    save(tmp_path, 1)
    (tmp_path / "step_000001" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"cannot resume: step_000001: .*trainer_state"):
        latest_checkpoint(tmp_path)


def test_large_files_are_checked_by_size_only(tmp_path, monkeypatch):
    monkeypatch.setattr("cagrpo_ray.checkpoints.HASH_LIMIT_BYTES", 100)
    save(tmp_path, 1)
    files = json.loads((tmp_path / "step_000001" / MANIFEST).read_text())["files"]
    assert "sha256" not in files["learner/global_step/model.pt"]  # 700 bytes > 100
    assert "sha256" in files["trainer_state.json"]
    assert HASH_LIMIT_BYTES == 64 * 2**20


def test_the_newest_n_are_kept_in_step_order(tmp_path):
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        save(tmp_path, step, keep=2)
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    assert names == ["step_1000000", "step_1000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1000001"
    with pytest.raises(ValueError, match="run.keep_checkpoints must be >= 1, got 0"):
        save(tmp_path, 7, keep=0)


def test_a_step_written_again_replaces_the_old_one(tmp_path):
    save(tmp_path, 4, payload=b"old")
    save(tmp_path, 4, payload=b"new")
    path = latest_checkpoint(tmp_path)
    assert (path / "learner/global_step/model.pt").read_bytes() == b"new" * 100
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000004"]


def test_a_complete_checkpoint_that_latest_does_not_name_yet_is_used(tmp_path, caplog):
    """A stop between the rename and the write of `latest`: the renamed one is complete."""
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / LATEST).write_text("step_000001")
    with caplog.at_level(logging.WARNING, logger="cagrpo_ray.checkpoints"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000002"
    assert "names step_000001" in caplog.text


def test_a_run_from_before_manifests_resumes_from_the_one_latest_names(tmp_path, caplog):
    for name in ("step_000001", "step_000002"):  # the old writer left step 2 half-written
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "trainer_state.json").write_text("{}")
    (tmp_path / LATEST).write_text("step_000001")
    with caplog.at_level(logging.WARNING, logger="cagrpo_ray.checkpoints"):
        assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert "step_000001 has no manifest (written before manifests)" in caplog.text
    assert "step_000002 is incomplete or corrupt" in caplog.text
    save(tmp_path, 3)  # once the run writes manifests, one without a manifest is incomplete
    save(tmp_path, 4)
    (tmp_path / "step_000004" / MANIFEST).unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"
