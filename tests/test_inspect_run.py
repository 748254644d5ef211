"""The token inspector on a real run (Ray, vLLM, DeepSpeed on the CPU): the learner keeps the
tokens of whole prompt groups at every inspected step, the driver writes them and serves the
newest step while the run trains, and the page carries the learner's values.

The learner's values are checked against an independent computation from the same records:
CA-GRPO's kernel weights over each group (the page's data-w) equal `cagrpo_token_weights` of
the learner's log-probs and the groups' advantages at the kappa the entropy controller set for
the step (from the run's metrics), their mean over a group's tokens is 1, and
the group's most extreme covariances have its smallest weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from short_run import INSPECT_GROUPS, STEPS
from test_inspect import page_tokens

from cagrpo_ray.algo.covariance import cagrpo_token_weights, token_covariance
from cagrpo_ray.inspect import inspected_steps, read_step, render_page
from cagrpo_ray.metrics.jsonl import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.preset]


@pytest.fixture(scope="module")
def inspected_run(short_run):
    """The session's short run (tests/short_run.py): inspected at every step, 2 groups each."""
    assert short_run.returncode == 0, short_run.console[-4000:]
    summary = json.loads((short_run.run_dir / "summary.json").read_text())
    return short_run.run_dir, summary, short_run.live


def test_every_step_keeps_whole_groups_with_the_learners_values(inspected_run):
    run_dir, summary, _ = inspected_run
    assert summary["inspect_dir"] == str(run_dir / "inspect")
    steps = list(range(1, STEPS + 1))
    assert inspected_steps(run_dir) == steps
    kappas = {r["step"]: r["cagrpo/kappa"] for r in read_metrics(run_dir / "metrics.jsonl")}
    for step in steps:
        table, metadata = read_step(run_dir, step)
        assert metadata["step"] == step and metadata["policy_loss"] == "cagrpo"
        groups = table.column("group_id").to_numpy()
        assert len(set(groups)) == INSPECT_GROUPS and table.num_rows == INSPECT_GROUPS * 8
        rows = table.to_pylist()
        lengths = [len(r["token_ids"]) for r in rows]
        width = max(lengths)
        mask = torch.tensor([[t < n for t in range(width)] for n in lengths])

        def padded(column, rows=rows, width=width):
            return torch.tensor([r[column] + [0.0] * (width - len(r[column])) for r in rows])

        logp, adv = padded("logprob"), torch.tensor([r["advantage"] for r in rows])
        gid = torch.tensor(groups)
        # on-policy: the learner's log-probs are the generator's, up to float32 rounding
        assert (logp - padded("behavior_logprob")).abs()[mask].max() < 1e-4
        want_c = token_covariance(logp, adv, mask, gid, scope="group")
        torch.testing.assert_close(padded("cov")[mask], want_c[mask], rtol=1e-4, atol=1e-6)
        # with the kappa the entropy controller gave this step
        kappa = kappas[step]
        want_w = cagrpo_token_weights(logp, adv, mask, gid, scope="group", kappa=kappa)
        weights = padded("weight")
        torch.testing.assert_close(weights[mask], want_w[mask], rtol=1e-4, atol=1e-6)
        for g in set(groups.tolist()):
            in_group = mask & (gid == g)[:, None]
            assert weights[in_group].mean().item() == pytest.approx(1.0, rel=1e-5)
            c = padded("cov")[in_group]
            if c.abs().max() > 0:
                assert weights[in_group][c.abs().argmax()] == weights[in_group].min()


def test_the_page_shows_exactly_the_records(inspected_run):
    run_dir, _, _ = inspected_run
    table, metadata = read_step(run_dir, STEPS)
    tokens = page_tokens(render_page(table, metadata, inspected_steps(run_dir)))
    rows = table.to_pylist()
    assert len(tokens) == sum(len(r["token_ids"]) for r in rows)
    flat = {key: [v for r in rows for v in r[column]] for key, column in
            (("w", "weight"), ("c", "cov"), ("logp", "logprob"), ("ent", "entropy"))}  # fmt: skip
    for key, values in flat.items():
        got = np.array([float(t[f"data-{key}"]) for t in tokens], dtype=np.float32)
        np.testing.assert_array_equal(got, np.array(values, dtype=np.float32))


def test_the_driver_served_the_newest_step_on_loopback_while_it_trained(inspected_run):
    _, _, live = inspected_run
    assert "page" in live, live
    assert live["url"].startswith("http://127.0.0.1:")
    assert "data-w=" in live["page"]
