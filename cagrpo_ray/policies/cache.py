"""Where built and converted policies are kept, shared by every way of making one."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/cagrpo_ray/policies`, with `~/.cache` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cagrpo_ray" / "policies"
