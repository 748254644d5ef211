"""Where built and converted policies are kept, and the error for a policy that cannot be had,
shared by every way of making one."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/cagrpo_ray/policies`, with `~/.cache` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cagrpo_ray" / "policies"


class PolicyPathError(ValueError):
    """model.path names no policy that can be had here: neither a folder, nor a preset, nor a
    Hugging Face hub id, or a GGUF file that is missing or cannot be read (a run reports it in
    one line and exits with status 2)."""
