"""Small local policies: a character-level Qwen2 causal LM, random or warm-started on a task.

Building, caching and loading (`PolicySpec`, `ensure_policy`, `load_policy`, ...) live in
`cagrpo_ray.policies.build`, which is also the command line; it is not imported here so that
`python -m cagrpo_ray.policies.build` runs it once, as `__main__` only.
"""

from cagrpo_ray.policies.model import PolicySize, random_policy

__all__ = ["PolicySize", "random_policy"]
