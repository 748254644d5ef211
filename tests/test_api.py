"""The Python API's parts that need no cluster (cagrpo_ray/__init__.py, cagrpo_ray/api.py):
overrides given as Python values resolve as `--set` would, a callable reward function becomes
a module the reward pool can import, rows become a Parquet file, and importing the package
stays cheap. tests/test_train_api.py trains through `train()` for real."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cagrpo_ray.api import _as_set_strings, _data_path, _pickled_reward_function, train
from cagrpo_ray.config import ConfigError, load_config

pytestmark = pytest.mark.unit

CONFIG = "configs/cpu-tiny.yaml"


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_python_values_resolve_as_set_strings_do():
    values = {
        "run.steps": 3,
        "algorithm.lr": 1e-6,
        "algorithm.policy_loss": "grpo",
        "eval.temperatures": [0.7, 0],
        "data.dataset_config": {"min_terms": 2, "max_terms": 3},
        "run.output_dir": Path("/tmp/some where"),
        "run.name": "3",  # a string that YAML would read as a number
        "model.gguf_file": None,
    }
    sets = _as_set_strings(values)
    from_python = load_config(CONFIG, sets)
    from_cli = load_config(
        CONFIG,
        [
            "run.steps=3",
            "algorithm.lr=1e-6",
            "algorithm.policy_loss=grpo",
            "eval.temperatures=[0.7, 0]",
            "data.dataset_config={min_terms: 2, max_terms: 3}",
            "run.output_dir=/tmp/some where",
            "run.name='3'",
            "model.gguf_file=null",
        ],
    )
    assert from_python == from_cli
    assert from_python.algorithm.lr == 1e-6 and from_python.run.name == "3"
    assert _as_set_strings(["run.steps=3"]) == ["run.steps=3"]


def test_a_wrong_key_is_named_before_anything_starts():
    with pytest.raises(ConfigError, match=r"run.stepz: unknown key"):
        train(CONFIG, overrides={"run.stepz": 3})
    config = load_config(CONFIG)
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss: 'nope' is not one of"):
        train(config, overrides={"algorithm.policy_loss": "nope"})


def test_a_callable_becomes_an_importable_module():
    scale = random.uniform(0.5, 2.0)

    def mine(response: str, item: dict) -> float:  # a closure: pickled by value
        return scale * float(response.strip() == str(item["answer"]))

    path = _pickled_reward_function("mine", mine)
    assert path.suffix == ".py" and path.with_suffix(".pkl").exists()
    assert _pickled_reward_function("mine", mine) == path  # the same function, the same file
    # what the reward pool does with "file.py:fn", in a fresh interpreter
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('m', {str(path)!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(m.mine(' 7', {'answer': 7}), m.mine('8', {'answer': 7}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [repr(scale), "0.0"]
    spec = importlib.util.spec_from_file_location("m", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import inspect

    assert list(inspect.signature(module.mine).parameters) == ["response", "item"]


def test_bad_reward_function_names():
    with pytest.raises(ConfigError, match="'my-fn' is not a Python identifier"):
        _pickled_reward_function("my-fn", len)
    with pytest.raises(ConfigError, match=r"reward_functions\['f'\]: 3 is not callable"):
        _pickled_reward_function("f", 3)


def test_rows_become_a_parquet_file(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "solution": str(i + 1)}
        for i in range(5)
    ]
    path = Path(_data_path(rows, "data.path"))
    assert path.name == "path.parquet"
    assert pq.read_table(path).to_pylist() == rows
    import pandas as pd

    frame_path = _data_path(pd.DataFrame({"question": ["a", "b"], "answer": ["1", "2"]}), "k")
    assert pq.read_table(frame_path).to_pylist() == [
        {"question": "a", "answer": "1"},
        {"question": "b", "answer": "2"},
    ]
    assert _data_path("relative.jsonl", "data.path") == str(Path("relative.jsonl").resolve())
    with pytest.raises(ConfigError, match="data.path: no rows"):
        _data_path([], "data.path")
    with pytest.raises(ConfigError, match="data.eval_path: int is not a path"):
        _data_path(3, "data.eval_path")


def test_importing_the_package_and_train_is_cheap():
    code = (
        "import sys; from cagrpo_ray import train; import cagrpo_ray; "
        "print(sorted(m for m in ('torch', 'ray', 'vllm', 'transformers', 'pydantic', 'wandb')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_callable_reward_function_reaches_the_runs_reward_functions():
    """`train(reward_functions={"mine": fn})`'s override is what `reward.functions` takes: the
    config accepts it and the run's loader imports the same function by that name."""
    from cagrpo_ray.config import load_config
    from cagrpo_ray.rewards import load_reward_functions

    def mine(response, item):
        return float(response.strip() == str(item["answer"]))

    spec = f"{_pickled_reward_function('mine', mine)}:mine"
    config = load_config(
        "configs/cpu-tiny.yaml", [f"reward.functions.mine={spec}", "reward.weights={mine: 1.0}"]
    )
    assert config.reward.functions == {"mine": spec}
    loaded = load_reward_functions(config.reward.functions)
    assert list(loaded) == ["mine"] and loaded["mine"].spec == spec
