"""The one translation of the config into the learner's and the loss's settings
(`learner/settings.py`): every default defined once, every key carried, and the values the
config leaves open resolved where they are used."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cagrpo_ray.algo.registry import LossSpec
from cagrpo_ray.config import DEFAULT_TIS_CAP, Config, load_config
from cagrpo_ray.learner.settings import (
    DERIVED,
    LEARNER_KEYS,
    LOSS_KEYS,
    NOT_IN_CONFIG,
    LearnerSettings,
    config_value,
    learner_settings,
    loss_spec,
)

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "cagrpo_ray"
CONFIG_DIR = PACKAGE / "config"


def config_default_sources() -> dict[tuple[str, str], str]:
    """(section class, field) -> the source text of the default its `Field(...)` gives."""
    found = {}
    for path in CONFIG_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                call = getattr(item, "value", None)
                if not (isinstance(item, ast.AnnAssign) and isinstance(call, ast.Call)):
                    continue
                if getattr(call.func, "id", None) != "Field" or not call.args:
                    continue
                found[(node.name, item.target.id)] = ast.unparse(call.args[0])
    return found


def section_field(key: str):
    """(section class name, pydantic FieldInfo) of a dotted config key."""
    section, name = key.split(".")
    model = Config.model_fields[section].annotation
    return model.__name__, model.model_fields[name]


def settings_default_sources() -> dict[str, str]:
    """LearnerSettings field -> the source text of its default."""
    tree = ast.parse((PACKAGE / "learner" / "settings.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LearnerSettings"]
    return {
        item.target.id: ast.unparse(item.value)
        for item in cls.body
        if isinstance(item, ast.AnnAssign) and item.value is not None
    }


def test_each_loss_default_is_defined_once_in_the_spec_and_the_config_takes_it():
    """`algo/` imports nothing, so a loss option's default is LossSpec's and its config key
    names it (`LossSpec.kl_coef`) instead of writing a second one that could drift."""
    sources = config_default_sources()
    specs = {f.name: f for f in dataclasses.fields(LossSpec)}
    for field, key in LOSS_KEYS.items():
        section, info = section_field(key)
        source = sources[(section, key.split(".")[1])]
        assert source == f"LossSpec.{field}", (
            f"{key}'s default is written as {source!r}; take it from LossSpec.{field}, its one "
            "definition"
        )
        assert info.default == specs[field].default, key


def test_each_learner_default_is_defined_once_in_the_config_and_the_settings_take_it():
    """A learner setting copied from a config key states no default of its own: it takes the
    key's (as warmup_steps did not: 5 in the config, 0 in the learner)."""
    sources = settings_default_sources()
    settings = {f.name: f for f in dataclasses.fields(LearnerSettings)}
    for field, key in LEARNER_KEYS.items():
        assert sources[field] == f"_config_default({field!r})", (
            f"LearnerSettings.{field}'s default is written as {sources[field]!r}; take it from "
            f"{key}, its one definition"
        )
        assert settings[field].default == section_field(key)[1].default, field


def test_every_role_field_is_translated_or_said_not_to_be():
    learner = {f.name for f in dataclasses.fields(LearnerSettings)}
    assert learner == set(LEARNER_KEYS) | set(DERIVED) | set(NOT_IN_CONFIG)
    assert {f.name for f in dataclasses.fields(LossSpec)} == set(LOSS_KEYS)


def test_the_config_does_not_rewrite_itself():
    for path in CONFIG_DIR.glob("*.py"):
        assert "object.__setattr__" not in path.read_text(), path.name


def test_every_learner_key_reaches_the_settings():
    overrides = {
        "learner.zero_stage": 3,
        "learner.micro_batch_size": 7,
        "algorithm.lr": 3e-5,
        "algorithm.warmup_steps": 2,
        "algorithm.lr_schedule": "cosine",
        "algorithm.min_lr_ratio": 0.1,
        "algorithm.weight_decay": 0.01,
        "algorithm.grad_clip": 0.5,
        "rollout.temperature": 0.7,
        "run.seed": 9,
        "model.dtype": "bfloat16",
        "learner.gradient_checkpointing": True,
        "learner.logits_chunk_mib": 256.0,
        "algorithm.ppo_epochs": 2,
        "algorithm.token_stats": "minibatch",
        "algorithm.measure_policy_change": True,
        "learner.length_buckets": 2,
        "learner.share_prompts": False,
        "learner.dist_timeout_s": 900.0,
    }
    assert set(overrides) == set(LEARNER_KEYS.values())
    more = ["rollout.prompts_per_step=4", "rollout.group_size=4", "algorithm.mini_batch_size=8",
            "rollout.max_tokens=48", "run.steps=30"]  # fmt: skip
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()] + more)
    settings = learner_settings(config, "policy-dir")
    default = learner_settings(Config(), "policy-dir")
    for field, key in LEARNER_KEYS.items():
        assert getattr(settings, field) == overrides[key] != getattr(default, field), field
    assert (settings.model_path, settings.max_response_length, settings.total_steps) == (
        "policy-dir",
        48,
        30,
    )
    assert settings.mini_batches == 2  # 16 responses in mini-batches of 8
    assert default.mini_batches == 1


def test_every_loss_option_reaches_the_spec():
    overrides = {
        "algorithm.policy_loss": "clip_cov",
        "algorithm.clip_eps_high": 0.28,
        "algorithm.kl_cov_coef": 0.5,
        "algorithm.cov_scope": "batch",
        "algorithm.entropy_coef": 0.01,
        "algorithm.loss_agg": "seq-mean-token-mean",
    }
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    spec = loss_spec(config)
    for field, key in LOSS_KEYS.items():
        if field != "tis_cap":
            assert getattr(spec, field) == config_value(config, key), field
    assert spec.name == "clip_cov" and spec.clip_eps_high == 0.28 and spec.cov_scope == "batch"


@pytest.mark.parametrize(
    "overrides, cap",
    [
        ([], None),  # synchronous: on-policy samples need no correction
        (["run.mode=async"], DEFAULT_TIS_CAP),
        (["run.max_staleness=3"], DEFAULT_TIS_CAP),
        (["run.mode=async", "algorithm.tis_cap=0"], None),  # explicitly off
        (["algorithm.tis_cap=1.5"], 1.5),
        (["run.mode=async", "algorithm.tis_cap=4"], 4.0),
    ],
)
def test_tis_cap_is_resolved_where_it_is_used_and_the_config_keeps_what_was_written(overrides, cap):
    config = load_config(None, overrides)
    written = config.algorithm.tis_cap
    assert loss_spec(config).tis_cap == cap
    assert config.algorithm.tis_cap == written  # the translation did not write back
    if not any("tis_cap" in o for o in overrides):
        assert written is None
