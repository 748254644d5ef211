"""The advantage-estimator registry (algo/advantages.py): every estimator against a plain float64
reference on fresh random rewards."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from cagrpo_ray.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    batch_advantages,
    group_advantages,
    register_advantage_estimator,
)

pytestmark = pytest.mark.unit

REWARD = st.one_of(st.sampled_from([0.0, 1.0, 0.5]), st.floats(-10, 10, width=32))


def reference_advantages(rewards, group_size, std_normalize=True, eps=1e-6):
    """GRPO (std_normalize) and Dr.GRPO, group by group in plain Python floats."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        mean = sum(group) / len(group)
        if std_normalize and len(group) > 1:
            std = (sum((r - mean) ** 2 for r in group) / (len(group) - 1)) ** 0.5
            out += [(r - mean) / (std + eps) for r in group]
        else:
            out += [r - mean for r in group]
    return np.array(out)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 6).flatmap(
        lambda g: st.tuples(
            st.just(g), arrays(np.float32, st.integers(1, 4).map(lambda n: n * g), elements=REWARD)
        )
    ),
    st.sampled_from(["grpo", "dr_grpo"]),
)
def test_matches_reference(group_and_rewards, estimator):
    group_size, rewards = group_and_rewards
    got = group_advantages(torch.from_numpy(rewards), group_size, estimator)
    want = reference_advantages(rewards, group_size, std_normalize=estimator == "grpo")
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_group_of_equal_rewards_has_zero_advantage():
    rewards = torch.tensor([0.1] * 12 + [0.0, 1.0, 1.0, 0.0] * 3)
    a = group_advantages(rewards, 12)
    assert torch.equal(a[:12], torch.zeros(12))
    assert a[12:].abs().min() > 0.5


def test_grpo_uses_unbiased_std_and_dr_grpo_does_not_divide():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    std = rewards.std()  # unbiased, 0.5
    expected = (rewards - 0.25) / (std + 1e-6)
    torch.testing.assert_close(group_advantages(rewards, 4), expected)
    torch.testing.assert_close(group_advantages(rewards, 4, "dr_grpo"), rewards - 0.25)


def test_group_of_one_and_float64():
    assert torch.equal(group_advantages(torch.tensor([3.0, 1.0]), 1), torch.zeros(2))
    a = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2)
    assert a.dtype == torch.float64


@pytest.mark.parametrize("rewards, group_size", [(torch.zeros(5), 2), (torch.zeros(2, 2), 2)])
def test_rejects_incomplete_groups(rewards, group_size):
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, group_size)


def test_an_unknown_estimator_names_the_known_ones():
    with pytest.raises(ValueError, match="'nope' is not one of grpo, dr_grpo"):
        group_advantages(torch.zeros(4), 2, "nope")


def test_a_registered_estimator_is_one_function_and_one_name():
    @register_advantage_estimator("test_max_baseline")
    def max_baseline(rewards):
        return rewards - rewards.max(dim=1, keepdim=True).values

    try:
        got = group_advantages(torch.tensor([1.0, 3.0, 2.0, 0.0]), 2, "test_max_baseline")
        assert got.tolist() == [-2.0, 0.0, 0.0, -2.0]
        mask = torch.ones(4, 3, dtype=torch.bool)
        assert batch_advantages(got, mask, "test_max_baseline") is got  # no batch stage
    finally:
        ADVANTAGE_ESTIMATORS.remove("test_max_baseline")


def reference_rloo(rewards, group_size):
    """RLOO as its definition: r_i minus the mean of the other rewards of its group."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        for i, r in enumerate(group):
            others = [group[j] for j in range(len(group)) if j != i]
            out.append(r - sum(others) / len(others))
    return np.array(out)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8).flatmap(
        lambda g: st.tuples(
            st.just(g), arrays(np.float32, st.integers(1, 4).map(lambda n: n * g), elements=REWARD)
        )
    )
)
def test_rloo_matches_its_definition(group_and_rewards):
    group_size, rewards = group_and_rewards
    got = group_advantages(torch.from_numpy(rewards).double(), group_size, "rloo")
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), reference_rloo(rewards, group_size), atol=1e-12)
    # a group whose rewards are all equal has no signal
    equal = np.repeat(rewards[:1], group_size)
    assert not group_advantages(torch.from_numpy(equal), group_size, "rloo").any()


def test_rloo_needs_two_responses_per_group():
    with pytest.raises(ValueError, match="'rloo' needs groups of at least 2"):
        group_advantages(torch.zeros(3), 1, "rloo")


def reference_reinforce_pp(rewards, group_size, tokens):
    """REINFORCE++-baseline over a learner batch, in plain floats: each response's reward
    minus its group's mean (no baseline for a group of one), then normalised by the mean and
    population std of the values its trained tokens carry (`tokens[i]` of them)."""
    centred = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start : start + group_size]]
        baseline = sum(group) / len(group) if len(group) > 1 else 0.0
        centred += [r - baseline for r in group]
    per_token = [a for a, n in zip(centred, tokens, strict=True) for _ in range(int(n))]
    mean = sum(per_token) / len(per_token)
    var = sum((a - mean) ** 2 for a in per_token) / len(per_token)
    return np.array([(a - mean) / max(var, 1e-8) ** 0.5 for a in centred])


@pytest.mark.parametrize("trial", range(30))
def test_reinforce_pp_normalises_over_the_learner_batch_however_it_was_assessed(trial):
    """Groups are assessed chunk by chunk as their rewards come back; the batch stage runs on
    the batch the learner trains on, so the advantages do not depend on the chunks."""
    from cagrpo_ray.algo.recipe import Recipe
    from cagrpo_ray.config import Config

    rng = np.random.default_rng()  # fresh inputs every run
    groups, size, T = int(rng.integers(1, 9)), int(rng.integers(1, 9)), int(rng.integers(1, 30))
    rewards = rng.choice([0.0, 1.0, 0.25, float(rng.normal())], size=groups * size)
    rewards = rewards.astype(np.float32)
    mask = torch.from_numpy(rng.random((groups * size, T)) < rng.uniform(0.2, 1.0))
    mask[int(rng.integers(groups * size))] = True  # at least one trained token
    truncated = torch.from_numpy(rng.random(groups * size) < 0.2)
    algorithm = Config().algorithm.model_copy(
        update={"advantage_estimator": "reinforce_pp", "overlong": "mask"}
    )
    recipe = Recipe(algorithm.recipe_spec(size, 64))
    cuts = sorted(
        rng.choice(np.arange(1, groups), size=int(rng.integers(0, groups)), replace=False)
    )
    chunks = np.split(np.arange(groups), cuts)  # the chunks the groups were assessed in
    assessed = np.concatenate(
        [
            recipe.assess_groups(
                rewards[c[0] * size : (c[-1] + 1) * size].tolist(), [1] * len(c) * size
            ).advantages
            for c in chunks
        ]
    )
    trained = recipe.token_mask(mask, truncated)
    got = recipe.batch_advantages(torch.from_numpy(assessed), trained)
    assert got.dtype == torch.float32
    tokens = trained.sum(1).numpy()
    if tokens.sum() == 0:  # every trained token was masked: nothing to normalise over
        np.testing.assert_array_equal(got.numpy(), assessed)
        return
    want = reference_reinforce_pp(rewards, size, tokens)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    # over the trained tokens, the advantages have mean 0 and (unless all equal) variance 1
    per_token = np.repeat(got.numpy().astype(np.float64), tokens)
    assert abs(per_token.mean()) < 1e-5
    assert per_token.var() == pytest.approx(1.0, abs=1e-4) or per_token.var() < 1e-8


def test_reinforce_pp_group_stage_is_the_mean_baseline_and_only_it_has_a_batch_stage():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 3.0], dtype=torch.float64)
    group = group_advantages(rewards, 4, "reinforce_pp")
    assert group.tolist() == [0.75, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, 0.75]
    assert torch.equal(group_advantages(rewards, 1, "reinforce_pp"), rewards)  # no baseline
    mask = torch.ones(8, 3, dtype=torch.bool)
    normalised = batch_advantages(group.float(), mask, "reinforce_pp")
    assert normalised.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    for name in ("grpo", "dr_grpo", "rloo"):
        assert batch_advantages(group, mask, name) is group
