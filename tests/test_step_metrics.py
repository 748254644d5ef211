"""A learner step's metrics of generation and scoring (`counter_metrics`): the differences of
the loop's running totals over the step, on fresh random totals, against the definitions
written out here."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cagrpo_ray.driver.loop import Counters, counter_metrics

pytestmark = pytest.mark.unit

NAMES = ("gsm8k/strict_format", "fmt/len")


@st.composite
def totals(draw):
    """Totals at a step's start, and at its end (each no smaller)."""
    ints = st.integers(0, 10_000)
    start = {name: draw(ints) for name in ("tokens", "errors", "unparsed", "scored", "span",
                                           "penalized", "dropped", "filtered")}  # fmt: skip
    grown = {name: value + draw(ints) for name, value in start.items()}
    busy = draw(st.floats(0, 1e4)), draw(st.floats(0, 1e4))
    have = draw(st.sets(st.sampled_from(NAMES)))
    earlier = {name: draw(st.floats(0, 1e3)) for name in have if draw(st.booleans())}
    later = {name: earlier.get(name, 0.0) + draw(st.floats(0, 1e3)) for name in have}

    def counters(t, seconds, components):
        return Counters(seconds, float(t["tokens"]), t["errors"], t["unparsed"], t["scored"],
                        tuple(components.items()), t["span"], t["penalized"], t["dropped"],
                        t["filtered"])  # fmt: skip

    return counters(start, busy[0], earlier), counters(grown, busy[0] + busy[1], later)


@settings(max_examples=200, deadline=None)
@given(totals(), st.floats(1e-3, 1e3), st.integers(1, 8), st.booleans())
def test_a_steps_metrics_are_what_the_totals_grew_by(pair, seconds, replicas, in_flight):
    before, after = pair
    got = counter_metrics(before, after, seconds, replicas, in_flight)
    scored = max(1, after.scored_responses - before.scored_responses)
    generated = after.tokens_generated - before.tokens_generated
    idle = 1 - (after.busy_seconds - before.busy_seconds) / (replicas * seconds)
    want = {
        "reward/verifier_errors": after.verifier_errors - before.verifier_errors,
        "reward/unparsed_fraction": (after.unparsed - before.unparsed) / scored,
        "throughput/generated_tokens_per_s": generated / seconds,
        "buffer/dropped_this_step": after.dropped_stale - before.dropped_stale,
        "dynamic_sampling/filtered_groups": after.filtered_groups - before.filtered_groups,
        "reward/overlong_penalized": after.overlong_penalized - before.overlong_penalized,
        "generators/idle_fraction": min(1.0, max(0.0, idle)),
        "tokens/generated": generated,
    }
    earlier = dict(before.components)
    for name, total in after.components:
        want[f"reward/{name}"] = (total - earlier.get(name, 0.0)) / scored
    if in_flight:
        want["rollout/spanning_load_fraction"] = (
            after.spanning_loads - before.spanning_loads
        ) / scored
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-12, abs_tol=1e-12), key
