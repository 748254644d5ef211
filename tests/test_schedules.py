"""The learning-rate schedule (`algo/schedules.py`) against hand-computed values and verl's."""

import math

import pytest
import torch

from cagrpo_ray.algo.schedules import LR_SCHEDULES, lr_factor
from cagrpo_ray.learner.settings import LearnerSettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("warmup", range(8))
def test_constant_is_the_learners_old_warm_up_bit_for_bit(warmup):
    def before(s):  # the LambdaLR of learner.py before schedules existed
        return min(1.0, (s + 1) / warmup) if warmup else 1.0

    for step in range(60):
        assert lr_factor(step, None, warmup) == before(step)
        assert lr_factor(step, 40, warmup, "constant", 0.3) == before(step)


def test_warm_up_by_hand():
    assert [lr_factor(s, None, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    for kind in LR_SCHEDULES:  # the same warm-up in front of every schedule
        assert [lr_factor(s, 10, 4, kind) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert lr_factor(0, 10, 0, kind) == 1.0  # no warm-up


def test_linear_by_hand():
    # W = 2, T = 10, m = 0.1: p = (s - 2) / 8
    factors = [lr_factor(s, 10, 2, "linear", 0.1) for s in range(12)]
    want = [0.5, 1.0, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125, 0.1, 0.1]
    assert factors == pytest.approx(want, abs=1e-12)


def test_cosine_by_hand():
    # W = 2, T = 10: p = (s - 2) / 8; m + (1 - m) (1 + cos(pi p)) / 2
    half = math.sqrt(0.5)
    assert lr_factor(2, 10, 2, "cosine") == 1.0
    assert lr_factor(4, 10, 2, "cosine") == pytest.approx((1 + half) / 2)  # p = 1/4
    assert lr_factor(6, 10, 2, "cosine") == pytest.approx(0.5)  # p = 1/2
    assert lr_factor(8, 10, 2, "cosine") == pytest.approx((1 - half) / 2)  # p = 3/4
    assert lr_factor(10, 10, 2, "cosine") == pytest.approx(0.0, abs=1e-15)
    assert lr_factor(6, 10, 2, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    # past T it stays at m (the cosine would rise again: 0.5 at p = 3/2)
    assert lr_factor(14, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(2, 4, 0, "cosine") == pytest.approx(0.5)  # no warm-up: p = s / T


@pytest.mark.parametrize("warmup, total, m", [(0, 10, 0.0), (3, 20, 0.1), (5, 6, 0.25)])
def test_cosine_after_warm_up_is_verls(warmup, total, m):
    """verl/utils/torch_functional.py get_cosine_schedule_with_warmup, num_cycles 0.5."""

    def verl(s):
        progress = (s - warmup) / max(1, total - warmup)
        return max(m, (1 - m) / 2 * math.cos(2 * math.pi * 0.5 * progress) + (1 + m) / 2)

    for step in range(warmup, total + 1):
        assert lr_factor(step, total, warmup, "cosine", m) == pytest.approx(verl(step), abs=1e-12)


def test_a_torch_scheduler_follows_the_factors():
    """How learner.py uses it: a LambdaLR steps once per optimizer step."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, 10, 2, "cosine", 0.1)
    )
    lrs = []
    for _ in range(10):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.1 * lr_factor(s, 10, 2, "cosine", 0.1) for s in range(10)])
    assert lrs[0] == pytest.approx(0.05) and lrs[-1] > 0.01


def test_bad_arguments_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        lr_factor(0, 10, 0, "step")
    with pytest.raises(ValueError, match="cosine schedule needs total_steps"):
        lr_factor(5, None, 2, "cosine")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        lr_factor(0, 10, 0, "linear", 1.5)
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_factor(0, 10, -1)


def test_learner_settings_check_the_schedule():
    assert LearnerSettings("m").lr_schedule == "constant"  # the default needs no total_steps
    LearnerSettings("m", lr_schedule="cosine", total_steps=100, min_lr_ratio=0.1)
    with pytest.raises(ValueError, match="constant, linear, cosine"):
        LearnerSettings("m", lr_schedule="exp")
    with pytest.raises(ValueError, match="total_steps"):
        LearnerSettings("m", lr_schedule="linear")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        LearnerSettings("m", min_lr_ratio=-0.1)
