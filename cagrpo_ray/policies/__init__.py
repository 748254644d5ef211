"""Small local policies: a character-level Qwen2 causal LM, random or warm-started on a task.

Building, caching and loading (`PolicySpec`, `ensure_policy`, `load_policy`, ...) live in
`cagrpo_ray.policies.build`, which is also the command line; it is not imported here so that
`python -m cagrpo_ray.policies.build` runs it once, as `__main__` only. Nor is the model
until asked for: a run's driver reads `policies.lora` and `policies.tokenizer` only, and the
model's import (transformers' Qwen2 classes) took ~2 s of its start.
"""

__all__ = ["PolicySize", "random_policy"]


def __getattr__(name: str):
    if name in __all__:
        from cagrpo_ray.policies import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
