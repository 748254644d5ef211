"""One registry type for every algorithm entry, entries chosen by name in the config, and a
user's own entries from a plugin file (`algorithm.plugins`) with no package file touched.

The run that trains with a plugin's estimator and loss is `tests/test_estimator_run.py`.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from cagrpo_ray.algo import (
    ADVANTAGE_ESTIMATORS,
    GROUP_FILTERS,
    REGISTRIES,
    TOKEN_MASKS,
    Recipe,
    register_advantage_estimator,
    register_group_filter,
    register_token_mask,
)
from cagrpo_ray.algo.registries import Registry, RegistryError
from cagrpo_ray.config import ConfigError, load_config
from cagrpo_ray.config import plugins as plugin_loader

pytestmark = pytest.mark.unit


@pytest.fixture
def registries_kept():
    """Whatever a test registers (itself, or through a plugin) is forgotten after it."""
    before = [set(registry) for registry in REGISTRIES]
    loaded = set(plugin_loader._loaded)
    yield
    for registry, names in zip(REGISTRIES, before, strict=True):
        for name in set(registry) - names:
            registry.remove(name)
    for key in set(plugin_loader._loaded) - loaded:
        del plugin_loader._loaded[key]


def test_every_registry_is_one_type():
    assert all(isinstance(registry, Registry) for registry in REGISTRIES)
    assert {registry.what for registry in REGISTRIES} == {
        "advantage estimator", "policy loss", "reward shaping", "group filter", "token mask",
        "controller",
    }  # fmt: skip


def test_a_name_registered_twice_is_refused_naming_both_definitions(registries_kept):
    with pytest.raises(RegistryError) as err:

        @register_advantage_estimator("grpo")
        def my_grpo(rewards):
            return rewards

    message = str(err.value)
    assert "advantage estimator 'grpo' is registered twice" in message
    assert "cagrpo_ray.algo.advantages.grpo (" in message and "advantages.py:" in message
    assert "my_grpo (" in message and "test_registries.py:" in message
    assert ADVANTAGE_ESTIMATORS["grpo"].group.__name__ == "grpo"  # the built-in one kept


def test_the_same_definition_registered_again_replaces_itself():
    registry = Registry("thing", takes=1)

    def one(x):
        return x

    registry.add("one", "first", one)
    registry.add("one", "second", one)  # its module executed a second time
    assert registry.lookup("one") == "second" and list(registry) == ["one"]


def test_a_function_with_the_wrong_signature_is_refused_when_registered(registries_kept):
    with pytest.raises(RegistryError, match=r"token mask 'two_masks'.*must take 2 positional"):

        @register_token_mask("two_masks")
        def one_argument(mask):
            return mask

    assert "two_masks" not in TOKEN_MASKS
    with pytest.raises(RegistryError, match="non-empty name"):
        register_group_filter("")(lambda rewards: rewards)


def test_lookup_of_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="group filter 'nope' is not one of dynamic_sampling"):
        GROUP_FILTERS.lookup("nope")


def test_recipe_entries_are_chosen_by_name_and_the_switches_are_spellings_of_them():
    config = load_config(None, ["algorithm.group_filters=[dynamic_sampling]",
                                "algorithm.token_masks=[overlong]"])  # fmt: skip
    spec = config.algorithm.recipe_spec(4, 64)
    assert spec.group_filters == ("dynamic_sampling",) and spec.token_masks == ("overlong",)
    switched = load_config(None, ["algorithm.dynamic_sampling=true", "algorithm.overlong=mask"])
    assert switched.algorithm.recipe_spec(4, 64) == spec  # the same recipe
    both = load_config(None, ["algorithm.dynamic_sampling=true",
                              "algorithm.group_filters=[dynamic_sampling]"])  # fmt: skip
    assert both.algorithm.recipe_spec(4, 64).group_filters == ("dynamic_sampling",)  # once
    shaped = load_config(None, ["algorithm.reward_shaping=[overlong_penalty]",
                                "algorithm.overlong_buffer_len=16"])  # fmt: skip
    rewards = Recipe(shaped.algorithm.recipe_spec(2, 64)).assess_groups([1.0, 1.0], [10, 64])
    assert rewards.rewards.tolist() == [1.0, 0.0]  # the penalty, chosen by its name
    for overrides, fragment in (
        (["algorithm.token_masks=[nope]"], "algorithm.token_masks: 'nope' is not one of overlong"),
        (["algorithm.reward_shaping=[overlong_penalty]"], "overlong_buffer_len <= "),
        (["algorithm.controllers=[kappa_entropy]", "algorithm.policy_loss=grpo"],
         "policy_loss is 'grpo'"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert fragment in str(err.value), overrides


PLUGIN = """
import torch
from cagrpo_ray.algo import register_advantage_estimator, register_policy_loss

@register_advantage_estimator("{prefix}_max_baseline")
def max_baseline(rewards):
    return rewards - rewards.max(dim=1, keepdim=True).values

@register_policy_loss("{prefix}_pg")
def pg(x):
    return -x.advantages * x.ratio, {{}}
"""


def write(path, text: str):
    path.write_text(textwrap.dedent(text))
    return path


def test_a_plugin_files_names_are_config_values_in_the_driver(
    registries_kept, tmp_path, monkeypatch
):
    write(tmp_path / "my_algo.py", PLUGIN.format(prefix="mine"))
    monkeypatch.chdir(tmp_path)  # a relative path is the working directory's
    config = load_config(None, ["algorithm.plugins=[my_algo.py]",
                                "algorithm.advantage_estimator=mine_max_baseline",
                                "algorithm.policy_loss=mine_pg"])  # fmt: skip
    assert config.algorithm.plugins == [str(tmp_path / "my_algo.py")]  # absolute: for the ranks
    recipe = Recipe(config.algorithm.recipe_spec(2, 64))
    got = recipe.assess_groups([1.0, 3.0, 2.0, 0.0], [5, 5, 5, 5]).advantages
    assert got.tolist() == [-2.0, 0.0, 0.0, -2.0]
    new = torch.zeros(2, 3, requires_grad=True)
    from cagrpo_ray.algo import policy_loss

    x = torch.zeros(2, 3)
    policy_loss("mine_pg", new, x, torch.tensor([1.0, -1.0]), torch.ones(2, 3)).loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-1.0] * 3, [1.0] * 3]) / 6)
    # loaded once per process: naming it again registers nothing twice
    load_config(None, [f"algorithm.plugins=[{tmp_path / 'my_algo.py'}]"])


def test_the_example_plugin_trains_its_entries_by_name(registries_kept):
    config = load_config(["configs/cpu-tiny.yaml", "examples/my_algorithm/config.yaml"])
    a = config.algorithm
    assert (a.advantage_estimator, a.policy_loss, a.group_filters) == (
        "median_baseline", "reinforce", ["some_correct"],
    )  # fmt: skip
    recipe = Recipe(a.recipe_spec(3, 64))
    outcome = recipe.assess_groups([0.0, 1.0, 5.0, 0.0, 0.0, 0.0], [4] * 6)
    assert outcome.advantages.tolist() == [-1.0, 0.0, 4.0, 0.0, 0.0, 0.0]
    assert outcome.keep == [True, False]  # no response of the second group scored above 0


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
        ("raise RuntimeError('half written')\n", "RuntimeError: half written"),
        (
            "from cagrpo_ray.algo import register_policy_loss\n"
            "@register_policy_loss('grpo')\n"
            "def grpo(x):\n    return x.ratio, {}\n",
            "policy loss 'grpo' is registered twice: by cagrpo_ray.algo.losses.grpo",
        ),
        (
            "from cagrpo_ray.algo import register_reward_shaping\n"
            "@register_reward_shaping('scaled')\n"
            "def scaled(rewards):\n    return rewards\n",
            "reward shaping 'scaled'",
        ),
    ],
    ids=["import", "raises", "taken name", "signature"],
)
def test_a_plugin_that_cannot_be_used_stops_the_config_naming_it(
    registries_kept, tmp_path, source, fragment
):
    plugin = write(tmp_path / "broken_algo.py", source)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"algorithm.plugins=[{plugin}]"])
    message = str(err.value)
    assert f"plugin '{plugin}' cannot be used" in message and fragment in message, message


def test_a_missing_plugin_file_is_named():
    with pytest.raises(ConfigError, match=r"plugin 'no/such/file.py' cannot be used.*no file"):
        load_config(None, ["algorithm.plugins=[no/such/file.py]"])


def test_the_describe_listing_includes_a_plugins_names(registries_kept, tmp_path, capsys):
    from cagrpo_ray.config.loading import main

    write(tmp_path / "listed.py", PLUGIN.format(prefix="listed"))
    config = tmp_path / "config.yaml"
    config.write_text(f"algorithm:\n  plugins: [{tmp_path / 'listed.py'}]\n")
    assert main(["--config", str(config), "--describe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [line for line in lines if line.startswith("algorithm.advantage_estimator =")]
    assert line.endswith("One of: grpo, dr_grpo, rloo, reinforce_pp, listed_max_baseline.")
