"""Small local policies: a character-level Qwen2 causal LM, random or warm-started on a task."""

from cagrpo_ray.policies.model import PolicySize, random_policy

__all__ = ["PolicySize", "random_policy"]
