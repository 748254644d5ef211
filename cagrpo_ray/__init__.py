"""cagrpo_ray: RLVR with CA-GRPO on Ray, vLLM and DeepSpeed.

    from cagrpo_ray import train
    result = train("configs/cpu-tiny.yaml", overrides={"run.steps": 3})
    result.run_dir, result.eval_before["pass@1"], result.eval_after["pass@1"]

Importing the package, or `train` from it, imports nothing else: the config, Ray, torch and
vLLM load when `train` is called (`cagrpo_ray.api.train` has the whole signature).
"""

__all__ = ["TrainResult", "train"]


def train(config="configs/cpu-tiny.yaml", overrides=None, **options):
    """`cagrpo_ray.api.train`: train as `python -m cagrpo_ray.run` does and return a
    `TrainResult` (run_dir, eval_before, eval_after, summary). `options`: reward_functions,
    train_data, eval_data, resume."""
    from cagrpo_ray.api import train as api_train

    return api_train(config, overrides, **options)


def __getattr__(name: str):
    if name == "TrainResult":
        from cagrpo_ray.api import TrainResult

        return TrainResult
    raise AttributeError(f"module 'cagrpo_ray' has no attribute {name!r}")
