"""A torch extension build lock left by a killed build is cleared at a learner's start; a lock a
build still holds is not (cagrpo_ray/learner/distributed.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from torch.utils.cpp_extension import FileBaton

from cagrpo_ray.learner.distributed import (
    COMM_EXTENSION,
    STALE_LOCK_S,
    clear_stale_build_lock,
    comm_extension_dir,
    use_environment_ninja,
)

pytestmark = pytest.mark.unit


def lock_aged(build_dir, age_s: float):
    lock = build_dir / "lock"
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_no_lock_is_nothing_to_do(tmp_path):
    assert clear_stale_build_lock(tmp_path) is False


def test_an_old_lock_with_no_build_running_is_removed_and_the_baton_can_be_taken(tmp_path):
    lock = lock_aged(tmp_path, STALE_LOCK_S + 30)
    assert not FileBaton(str(lock)).try_acquire()  # what made every later learner wait
    assert clear_stale_build_lock(tmp_path) is True
    assert not lock.exists()
    baton = FileBaton(str(lock))
    assert baton.try_acquire()
    baton.release()


def test_a_young_lock_is_left_to_its_build(tmp_path):
    lock = lock_aged(tmp_path, STALE_LOCK_S / 4)
    assert clear_stale_build_lock(tmp_path) is False
    assert lock.exists()


def test_an_old_lock_is_kept_while_a_process_works_in_the_build_folder(tmp_path):
    # ninja and its compilers run in the build folder for the whole build
    lock = lock_aged(tmp_path, STALE_LOCK_S * 5)
    builder = subprocess.Popen(["sleep", "30"], cwd=tmp_path)
    try:
        assert clear_stale_build_lock(tmp_path) is False
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_build_lock(tmp_path) is True


def test_the_folder_is_the_one_deepspeed_builds_its_cpu_comm_extension_in():
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    assert COMM_EXTENSION == ShareMemCommBuilder.NAME
    folder = comm_extension_dir()
    assert folder.name == ShareMemCommBuilder.NAME
    assert "torch_extensions" in str(folder) or "TORCH_EXTENSIONS_DIR" in os.environ


@pytest.mark.parametrize("venv_first", [False, True])
def test_every_learner_builds_with_the_environments_ninja_whatever_its_path(
    monkeypatch, venv_first
):
    # A Ray job puts the environment's bin first on PATH, a plain `python -m` does not; the two
    # ninjas (Debian's 1.11, the wheel's 1.13) record build commands differently, so each
    # rebuilt what the other had built.
    venv_bin = os.path.dirname(sys.executable)
    if not os.path.isfile(os.path.join(venv_bin, "ninja")):
        pytest.skip("this environment has no ninja of its own (DeepSpeed installs one)")
    others = "/usr/local/bin:/usr/bin:/bin"
    monkeypatch.setenv("PATH", f"{venv_bin}:{others}" if venv_first else others)
    ninja = use_environment_ninja()
    assert ninja == os.path.join(venv_bin, "ninja")
    assert shutil.which("ninja") == ninja
    path = os.environ["PATH"]
    assert use_environment_ninja() == ninja and os.environ["PATH"] == path  # once only
    assert path.endswith(others)
