"""The typed config: defaults, YAML, overrides and the error messages users see."""

from pathlib import Path

import pytest

from cagrpo_ray.config import (
    Config,
    ConfigError,
    describe_fields,
    load_config,
    main,
)
from cagrpo_ray.learner.settings import loss_spec

pytestmark = pytest.mark.unit

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_defaults_validate_and_every_field_is_described():
    config = Config()
    assert config.algorithm.policy_loss == "cagrpo"
    lines = describe_fields()
    assert len(lines) > 40
    for line in lines:
        key, _, help_text = line.partition("#")
        assert help_text.strip() and help_text.strip() != "None", f"no description: {key}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    load_config(path)


def test_wrong_literal_names_key_given_and_allowed():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.policy_loss=cagrpo2"])
    expected = "algorithm.policy_loss: 'cagrpo2' is not one of grpo, cagrpo, clip_cov, kl_cov"
    assert expected in str(err.value)


def test_unknown_key_in_yaml_names_file_key_and_allowed(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout:\n  group_sise: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message
    assert "rollout.group_sise: unknown key" in message
    assert "group_size" in message


def test_unknown_section():
    with pytest.raises(ConfigError, match="algorithmm: unknown key; allowed keys here: run,"):
        load_config(None, ["algorithmm.lr=1"])


def test_overrides_parse_yaml_scalars_and_nest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  lr: 0.5\n  clip_eps_high: 0.28\n")
    config = load_config(path, ["algorithm.lr=1e-6", "rollout.group_size=12", "sync.backend=gloo"])
    assert config.algorithm.lr == pytest.approx(1e-6)
    assert config.algorithm.clip_eps_high == pytest.approx(0.28)
    assert config.rollout.group_size == 12
    assert config.sync.backend == "gloo"


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["run.steps=0"], "run.steps: 0 is invalid"),
        (["rollout.temperature=-1"], "rollout.temperature: -1 is invalid"),
        (["learner.zero_stage=4"], "learner.zero_stage: 4 is not one of 0, 1, 2, 3"),
        (["algorithm.lr"], "expected dotted.key=value"),
        (["run.steps=3", "run.steps.x=1"], "'steps' is a value, not a section"),
    ],
)
def test_bad_values_fail_with_the_key(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert fragment in str(err.value)


def test_cli_prints_resolved_config_and_rejects_bad_keys(capsys):
    assert main(["--set", "algorithm.lr=0.001"]) == 0
    assert "lr: 0.001" in capsys.readouterr().out
    assert main(["--set", "nope.x=1"]) == 2
    assert "nope: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, bound",
    [
        ([], 0),  # the default is the synchronous schedule
        (["run.mode=sync"], 0),
        (["run.mode=async"], 1),  # the shorthand's bound
        (["run.mode=async", "run.max_staleness=3"], 3),
        (["run.max_staleness=2"], 2),
        (["run.mode=async", "run.max_staleness=0"], 0),  # async with bound 0 is sync
    ],
)
def test_one_staleness_bound_with_mode_as_shorthand(overrides, bound):
    config = load_config(None, overrides)
    assert config.run.max_staleness == bound
    assert config.run.asynchronous == (bound > 0)


def test_contradictory_mode_and_bound_is_an_error_naming_both():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run.mode=sync", "run.max_staleness=2"])
    message = str(err.value)
    assert "run.mode 'sync'" in message and "run.max_staleness is 2" in message


def test_loss_names_come_from_the_registry_and_options_reach_the_spec():
    from dataclasses import fields

    from cagrpo_ray.algo.losses import POLICY_LOSSES, LossSpec

    config = load_config(None, ["algorithm.kl_cov_ratio=0.002", "algorithm.clip_cov_ub=4"])
    spec = loss_spec(config)
    assert spec.kl_cov_ratio == 0.002 and spec.clip_cov_ub == 4.0
    # the config's defaults are the spec's (tests/test_config_roles.py: defined once)
    default = loss_spec(Config())
    for f in fields(LossSpec):
        assert getattr(default, f.name) == f.default, f.name
    for name in POLICY_LOSSES:  # every registered loss is a valid value, and nothing else
        assert load_config(None, [f"algorithm.policy_loss={name}"]).algorithm.policy_loss == name
    with pytest.raises(ConfigError, match="algorithm.policy_loss: 'ppo' is not one of grpo, "):
        load_config(None, ["algorithm.policy_loss=ppo"])


def test_truncated_sampling_keys_are_removed_with_an_error_naming_the_key_and_why():
    for overrides, named in (
        (["rollout.top_p=0.9"], "rollout.top_p: removed"),
        (["rollout.top_k=20"], "rollout.top_k: removed"),
        (["rollout.top_p=1.0", "rollout.top_k=0"], "rollout.top_p and rollout.top_k: removed"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        message = str(err.value)
        assert named in message and "full softmax" in message, overrides
    assert "top_p" not in Config().rollout.model_dump()


def test_kl_estimator_reaches_the_spec_and_unknown_ones_are_refused():
    config = load_config(None, ["algorithm.kl_estimator=k1"])
    assert loss_spec(config).kl_estimator == "k1"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.kl_estimator=mse"])
    assert "algorithm.kl_estimator: 'mse' is not one of k1, abs, k2, k3" in str(err.value)


def test_dual_clip_bound_reaches_the_spec_and_is_above_one_or_off():
    assert loss_spec(load_config(None, ["algorithm.clip_ratio_c=10"])).clip_ratio_c == 10
    off = loss_spec(load_config(None, ["algorithm.clip_ratio_c=null"]))
    assert off.clip_ratio_c is None
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.clip_ratio_c=1"])
    assert "algorithm.clip_ratio_c: 1 is invalid" in str(err.value)


def test_lr_schedule_options():
    config = load_config(None, ["algorithm.lr_schedule=cosine", "algorithm.min_lr_ratio=0.1"])
    assert (config.algorithm.lr_schedule, config.algorithm.min_lr_ratio) == ("cosine", 0.1)
    for override, fragment in (
        ("algorithm.lr_schedule=step", "'step' is not one of constant, linear, cosine"),
        ("algorithm.min_lr_ratio=2", "algorithm.min_lr_ratio: 2 is invalid"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert fragment in str(err.value), override


def test_kernel_width_and_its_controller_options():
    config = load_config(None, ["algorithm.cagrpo_kappa=2", "algorithm.cagrpo_kernel=positive"])
    spec = loss_spec(config)
    assert (spec.cagrpo_kappa, spec.cagrpo_kernel) == (2.0, "positive")
    steered = load_config(None, ["algorithm.kappa_control=entropy",
                                 "algorithm.kappa_entropy_band=[0.8, 1.25]"])  # fmt: skip
    assert steered.algorithm.kappa_entropy_band == (0.8, 1.25)
    for overrides, fragment in (
        (["algorithm.cagrpo_kappa=0"], "algorithm.cagrpo_kappa: 0 is invalid"),
        (["algorithm.kappa_entropy_band=[1.1, 1.2]"], "0 < low < 1 < high"),
        (["algorithm.cagrpo_kappa=100"], "must contain cagrpo_kappa"),
        (["algorithm.kappa_control=entropy", "algorithm.policy_loss=grpo"],
         "policy_loss is 'grpo'"),
        (["algorithm.kappa_control=pid"], "'pid' is not one of off, entropy"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert fragment in str(err.value), overrides


def test_evaluation_temperatures_and_harder_split(tmp_path):
    config = load_config(None, ["eval.temperatures=[0.7, 0]", "eval.hard_config={min_terms: 5}"])
    assert config.eval.temperatures == [0.7, 0.0] and config.eval.hard_config == {"min_terms": 5}
    with pytest.raises(ConfigError) as err:
        load_config(None, ["eval.temperatures=[-0.5]"])
    assert "eval.temperatures must be >= 0" in str(err.value)
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.source=file", f"data.path={path}", f"data.eval_path={path}",
                           "eval.hard_config={min_terms: 5}"])  # fmt: skip
    assert "eval.hard_config describes a harder reasoning_gym split" in str(err.value)


def test_few_shot_turns_go_between_the_instruction_and_the_problem(smollm2_dir):
    from transformers import AutoTokenizer

    from cagrpo_ray.config import ConfigError, load_config
    from cagrpo_ray.data.prompts import format_prompt_text, prompt_preamble

    config = load_config("configs/cpu-smollm2-tools.yaml")
    turns = prompt_preamble(config.data)
    assert turns[0]["role"] == "system" and len(turns) == 1 + len(config.data.few_shot)
    text = format_prompt_text(AutoTokenizer.from_pretrained(smollm2_dir), "Calculate 1 + 2.", turns)
    parts = ("You have a calculator", "<tool>calculator: 12 + 30 * 2</tool>", "Calculate 1 + 2.")
    system, example, question = (text.index(part) for part in parts)
    assert system < example < question and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match=r"data.few_shot\[0\]"):
        load_config(None, ["data.few_shot=[{role: tool, content: x}]"])


def test_advantage_estimators_come_from_the_registry_and_describe_lists_them(capsys):
    from cagrpo_ray.algo.advantages import ADVANTAGE_ESTIMATORS

    assert Config().algorithm.advantage_estimator == "grpo"
    config = load_config(None, ["algorithm.advantage_estimator=dr_grpo"])
    assert config.algorithm.recipe_spec(8, 64).advantage_estimator == "dr_grpo"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.advantage_estimator=ppo"])
    allowed = ", ".join(ADVANTAGE_ESTIMATORS)
    assert f"algorithm.advantage_estimator: 'ppo' is not one of {allowed}" in str(err.value)
    assert main(["--describe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [line for line in lines if line.startswith("algorithm.advantage_estimator =")]
    assert line.endswith(f"One of: {allowed}.")
    (line,) = [line for line in lines if line.startswith("algorithm.policy_loss =")]
    assert line.endswith("One of: grpo, cagrpo, clip_cov, kl_cov.")


def test_the_old_std_normalize_key_names_its_replacement(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("algorithm:\n  std_normalize: false\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "algorithm.std_normalize is replaced by algorithm.advantage_estimator" in message
    assert "false is dr_grpo" in message
