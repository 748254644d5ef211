"""Scoring a chunk's groups: DAPO's soft overlong penalty and dynamic sampling, against the
formulas written out here (Yu et al. 2025)."""

from types import SimpleNamespace

import numpy as np
import pytest

from cagrpo_ray.algo.reference import group_advantages
from cagrpo_ray.config import Config
from cagrpo_ray.rollout.scoring import overlong_penalty, score_groups

pytestmark = pytest.mark.unit


def results(rewards):
    return [SimpleNamespace(reward=r, correct=r >= 1.0) for r in rewards]


def algorithm(**changes):
    return Config().algorithm.model_copy(update=changes)


def test_overlong_penalty_ramps_over_the_buffer():
    lengths = np.array([10, 40, 48, 56, 64])
    got = overlong_penalty(lengths, max_tokens=64, buffer_len=16, factor=1.0)
    # L_max - L_buf = 48: no penalty up to 48, then linear to -1 at 64
    np.testing.assert_allclose(got, [0, 0, 0, -0.5, -1.0])


def test_penalty_shapes_rewards_before_advantages_and_leaves_verdicts():
    rewards = [1.0, 1.0, 0.0, 1.0]
    lengths = [10, 64, 10, 56]
    a = algorithm(overlong="penalty", overlong_buffer_len=16)
    scored = score_groups(results(rewards), lengths, 4, a, max_tokens=64)
    shaped = np.array([1.0, 0.0, 0.0, 0.5], dtype=np.float32)
    np.testing.assert_allclose(scored.rewards, shaped)
    np.testing.assert_allclose(scored.advantages, group_advantages(shaped, 4), rtol=1e-6)
    assert scored.correct == [True, True, False, True] and scored.penalized == 2


def test_dynamic_sampling_keeps_only_groups_with_a_signal():
    rewards = [1, 1, 1, 1] + [0, 1, 0, 0] + [0, 0, 0, 0]
    off = score_groups(results(rewards), [5] * 12, 4, algorithm(), max_tokens=64)
    assert off.keep == [True, True, True]
    on = score_groups(
        results(rewards), [5] * 12, 4, algorithm(dynamic_sampling=True), max_tokens=64
    )
    assert on.keep == [False, True, False]
    # a penalty can give an all-correct group a signal (lengths differ): it is kept
    shaped = score_groups(
        results([1, 1, 1, 1]),
        [10, 64, 10, 10],
        4,
        algorithm(dynamic_sampling=True, overlong="penalty", overlong_buffer_len=16),
        max_tokens=64,
    )
    assert shaped.keep == [True]
