"""The kappa controller (algo/controllers.py): the rule of its docstring, checked against a
plain re-statement of it on fresh random entropy sequences, and its state round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cagrpo_ray.algo.controllers import KappaController

pytestmark = pytest.mark.unit


def expected_kappas(entropies, kappa, band, rate, bounds):
    """The kappa of every step, from the docstring's rule, written out independently."""
    out, h0 = [kappa], None
    for h in entropies:
        if h0 is None and h > 0:
            h0 = h
        if h0 is not None:
            r = h / h0
            if r > band[1]:
                kappa = kappa * math.exp(rate)
            elif r < band[0]:
                kappa = kappa / math.exp(rate)
            kappa = min(bounds[1], max(bounds[0], kappa))
        out.append(kappa)
    return out


@pytest.mark.parametrize("trial", range(20))
def test_kappa_follows_the_rule_on_random_entropy_paths(trial):
    rng = np.random.default_rng()  # fresh inputs every run
    steps = int(rng.integers(5, 200))
    # a random walk in log-entropy, sometimes leaving the band on either side
    entropies = list(0.1 * np.exp(np.cumsum(rng.normal(0, 0.08, steps))))
    band = (float(rng.uniform(0.5, 0.95)), float(rng.uniform(1.05, 1.5)))
    rate = float(rng.uniform(0.01, 0.5))
    bounds = (0.25, 16.0)
    kappa = float(rng.uniform(0.5, 4.0))
    controller = KappaController(kappa, band, rate, bounds)
    got = [controller.kappa] + [controller.update(h) for h in entropies]
    np.testing.assert_allclose(got, expected_kappas(entropies, kappa, band, rate, bounds))
    assert controller.reference_entropy == entropies[0]
    assert all(bounds[0] <= k <= bounds[1] for k in got)


def test_above_the_band_widens_below_narrows_inside_holds():
    c = KappaController(1.0, band=(0.9, 1.1), rate=0.5)
    assert c.update(0.2) == 1.0  # the reference itself: inside
    assert c.update(0.3) == pytest.approx(math.exp(0.5))  # too diffuse: towards GRPO
    assert c.update(0.21) == pytest.approx(math.exp(0.5))  # inside the band: held
    assert c.update(0.1) == pytest.approx(1.0)  # collapsing: sharper kernel
    for _ in range(50):
        c.update(0.01)
    assert c.kappa == 0.25  # the range's floor


def test_state_round_trip_continues_identically():
    a = KappaController(2.0, band=(0.8, 1.2), rate=0.2)
    for h in (0.3, 0.5, 0.4):
        a.update(h)
    b = KappaController.from_state(a.state())
    for h in (0.1, 0.6, 0.35):
        assert a.update(h) == b.update(h)
    assert a.state() == b.state()


def test_a_zero_first_entropy_waits_and_bad_values_are_refused():
    c = KappaController(1.0)
    assert c.update(0.0) == 1.0 and c.reference_entropy is None
    c.update(0.4)
    assert c.reference_entropy == 0.4
    with pytest.raises(ValueError, match="entropy"):
        c.update(float("nan"))
    with pytest.raises(ValueError, match="band"):
        KappaController(1.0, band=(1.1, 1.2))
    with pytest.raises(ValueError, match="kappa_range"):
        KappaController(100.0)
