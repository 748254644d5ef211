"""Small local policies: a character-level Qwen2 causal LM, random or warm-started on a task."""

from cagrpo_ray.policies.build import (
    PRESETS,
    PolicySpec,
    build_policy,
    cache_root,
    ensure_policy,
    load_policy,
    resolve_policy,
)
from cagrpo_ray.policies.model import PolicySize, random_policy

__all__ = [
    "PRESETS",
    "PolicySize",
    "PolicySpec",
    "build_policy",
    "cache_root",
    "ensure_policy",
    "load_policy",
    "random_policy",
    "resolve_policy",
]
