"""Where built and converted policies are kept, and the error for a policy that cannot be had,
shared by every way of making one."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from cagrpo_ray.errors import UserError

BUILD_INFO = "build_info.json"  # written last by every build: its presence marks a whole one


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/cagrpo_ray/policies`, with `~/.cache` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cagrpo_ray" / "policies"


def cached_build(key: str, build: Callable[[Path], object]) -> Path:
    """`cache_root() / key`, made first by `build(staging_dir)` when the cache lacks it.

    Concurrent callers wait on a lock file and build once; a build lands in the cache by an
    atomic rename, so an interrupted build never leaves a half-written policy behind.
    """
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / key
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / BUILD_INFO).is_file():
            return path
        staging = root / f".{key}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        build(staging)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(staging, path)
    return path


class PolicyPathError(UserError, ValueError):
    """model.path names no policy that can be had here: neither a folder, nor a preset, nor a
    Hugging Face hub id, or a GGUF file that is missing or cannot be read (a run reports it in
    one line and exits with status 2)."""
