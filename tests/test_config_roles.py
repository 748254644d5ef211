"""The one translation from the config to the roles (`config/roles.py`): every default defined
once, every key carried, and the values the config leaves open resolved where they are used."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from cagrpo_ray.algo.registry import LossSpec
from cagrpo_ray.config import DEFAULT_TIS_CAP, Config, learner_settings, load_config, loss_spec
from cagrpo_ray.config.roles import DERIVED, LEARNER_KEYS, LOSS_KEYS, NOT_IN_CONFIG, config_value
from cagrpo_ray.learner.settings import LearnerSettings

pytestmark = pytest.mark.unit

CONFIG_DIR = Path(__file__).resolve().parent.parent / "cagrpo_ray" / "config"


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


@pytest.mark.parametrize(
    "role, keys", [(LearnerSettings, LEARNER_KEYS), (LossSpec, LOSS_KEYS)], ids=lambda x: str(x)
)
def test_each_default_is_defined_once_in_the_role_and_the_config_takes_it(role, keys):
    """A config field copied into a role states no default of its own: its `Field` names the
    role's (`LearnerSettings.lr`), so a default cannot be written twice and drift (as
    warmup_steps did: 5 in the config, 0 in the learner)."""
    sources = config_default_sources()
    role_fields = {f.name: f for f in dataclasses.fields(role)}
    for field, key in keys.items():
        section, info = section_field(key)
        source = sources[(section, key.split(".")[1])]
        assert source == f"{role.__name__}.{field}", (
            f"{key}'s default is written as {source!r}; take it from {role.__name__}.{field}, "
            "its one definition"
        )
        assert info.default == role_fields[field].default, key


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
