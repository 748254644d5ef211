"""The recipe (algo/recipe.py): a chunk's groups through reward shaping, advantages and group
filters (DAPO's soft overlong penalty and dynamic sampling, Yu et al. 2025), the learner batch
through the token masks, and the controllers, against the formulas written out here."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from loss_reference import group_advantages

from cagrpo_ray.algo.controllers import KappaController
from cagrpo_ray.algo.recipe import Recipe
from cagrpo_ray.algo.shaping import overlong_penalty
from cagrpo_ray.config import Config

pytestmark = pytest.mark.unit


def recipe(group_size=4, max_tokens=64, **changes) -> Recipe:
    """The recipe of the default config's algorithm section with `changes` to its fields."""
    algorithm = Config().algorithm.model_copy(update=changes)
    return Recipe(algorithm.recipe_spec(group_size, max_tokens))


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = np.array([10, 40, 48, 56, 64])
    got = overlong_penalty(lengths, max_tokens=64, buffer_len=16, factor=1.0)
    # L_max - L_buf = 48: no penalty up to 48, then linear to -1 at 64
    np.testing.assert_allclose(got, [0, 0, 0, -0.5, -1.0])


def test_penalty_shapes_rewards_before_advantages():
    rewards = [1.0, 1.0, 0.0, 1.0]
    lengths = [10, 64, 10, 56]
    outcome = recipe(overlong="penalty", overlong_buffer_len=16).assess_groups(rewards, lengths)
    shaped = np.array([1.0, 0.0, 0.0, 0.5], dtype=np.float32)
    np.testing.assert_allclose(outcome.rewards, shaped)
    np.testing.assert_allclose(outcome.advantages, group_advantages(shaped, 4), rtol=1e-6)
    assert outcome.reshaped == 2


def test_default_recipe_is_grpo_on_the_verifiers_rewards():
    rng = np.random.default_rng()  # fresh inputs every run
    for _ in range(20):
        groups, size = int(rng.integers(1, 6)), int(rng.integers(2, 9))
        rewards = rng.choice([0.0, 0.5, 1.0, 1.1], size=groups * size).astype(np.float32)
        lengths = rng.integers(1, 64, size=groups * size)
        outcome = recipe(group_size=size).assess_groups(rewards.tolist(), lengths.tolist())
        assert outcome.rewards.dtype == np.float32 and outcome.advantages.dtype == np.float32
        np.testing.assert_array_equal(outcome.rewards, rewards)
        want = group_advantages(rewards, size)  # float64 loops
        np.testing.assert_allclose(outcome.advantages, want, rtol=1e-5, atol=1e-6)
        assert outcome.keep == [True] * groups and outcome.reshaped == 0


def test_dynamic_sampling_keeps_only_groups_with_a_signal():
    rewards = [1, 1, 1, 1] + [0, 1, 0, 0] + [0, 0, 0, 0]
    assert recipe().assess_groups(rewards, [5] * 12).keep == [True, True, True]
    on = recipe(dynamic_sampling=True)
    assert on.assess_groups(rewards, [5] * 12).keep == [False, True, False]
    # a penalty can give an all-correct group a signal (lengths differ): it is kept
    shaped = recipe(dynamic_sampling=True, overlong="penalty", overlong_buffer_len=16)
    assert shaped.assess_groups([1, 1, 1, 1], [10, 64, 10, 10]).keep == [True]


def test_a_group_filter_bounds_the_groups_assessed_per_batch():
    assert recipe().groups_assessed_limit(16) is None
    assert recipe(dynamic_sampling=True, max_gen_batches=3).groups_assessed_limit(16) == 48


def test_overlong_mask_removes_truncated_responses_only():
    rng = np.random.default_rng()
    mask = torch.from_numpy(rng.random((6, 9)) < 0.7)
    truncated = torch.tensor([True, False, False, True, False, False])
    none = recipe()
    assert none.token_mask(mask, truncated) is mask  # nothing configured: the same tensor
    masked = recipe(overlong="mask").token_mask(mask, truncated)
    want = mask.clone()
    want[truncated] = False
    assert torch.equal(masked, want)
    assert torch.equal(mask[~truncated], masked[~truncated])


def test_without_a_batch_stage_the_batch_advantages_are_the_groups():
    advantages = torch.randn(8)
    mask = torch.ones(8, 5, dtype=torch.bool)
    assert recipe().batch_advantages(advantages, mask) is advantages


def test_controllers_give_the_next_steps_options_and_log_the_used_ones():
    assert recipe().loss_options() is None
    assert recipe().observe({"entropy/mean": 0.3}) == {}
    band, rate = (0.9, 1.1), 0.5
    steered = recipe(kappa_control="entropy", kappa_entropy_band=band, kappa_rate=rate)
    replay = KappaController(1.0, band, rate)
    rng = np.random.default_rng()
    for entropy in 0.2 * np.exp(np.cumsum(rng.normal(0, 0.2, 30))):
        options = steered.loss_options()
        assert options == {"cagrpo_kappa": replay.kappa}
        assert steered.observe({"entropy/mean": float(entropy)}) == {"cagrpo/kappa": replay.kappa}
        replay.update(float(entropy))


def test_controller_state_round_trip_continues_identically():
    a = recipe(kappa_control="entropy", kappa_entropy_band=(0.9, 1.1), kappa_rate=0.3)
    for h in (0.3, 0.5, 0.4):
        a.observe({"entropy/mean": h})
    b = recipe(kappa_control="entropy", kappa_entropy_band=(0.9, 1.1), kappa_rate=0.3)
    b.restore(a.state())
    assert set(a.state()) == {"kappa_entropy"}
    for h in (0.1, 0.6, 0.35):
        assert a.observe({"entropy/mean": h}) == b.observe({"entropy/mean": h})
        assert a.loss_options() == b.loss_options()


def test_config_fields_select_the_registry_entries():
    algorithm = Config().algorithm.model_copy(
        update={"overlong": "penalty", "dynamic_sampling": True, "kappa_control": "entropy"}
    )
    spec = algorithm.recipe_spec(8, 256)
    assert (spec.group_size, spec.max_tokens, spec.advantage_estimator) == (8, 256, "grpo")
    assert spec.reward_shaping == ("overlong_penalty",) and spec.token_masks == ()
    assert spec.group_filters == ("dynamic_sampling",)
    assert spec.controllers == ("kappa_entropy",)
    masked = Config().algorithm.model_copy(update={"overlong": "mask"}).recipe_spec(8, 256)
    assert masked.token_masks == ("overlong",) and masked.reward_shaping == ()


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"reward_shaping": ("nope",)}, "reward shaping 'nope' is not one of overlong_penalty"),
        ({"group_filters": ("nope",)}, "group filter 'nope' is not one of dynamic_sampling"),
        ({"token_masks": ("nope",)}, "token mask 'nope' is not one of overlong"),
        ({"controllers": ("nope",)}, "controller 'nope' is not one of kappa_entropy"),
        ({"advantage_estimator": "nope"}, "advantage estimator 'nope' is not one of grpo"),
    ],
)
def test_an_unknown_entry_names_the_known_ones(entry, match):
    spec = Config().algorithm.recipe_spec(4, 64)
    with pytest.raises(ValueError, match=match):
        replace(spec, **entry)
