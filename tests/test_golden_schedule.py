"""The schedule's per-step numbers stay put unless a change means to move them.

`tests/golden/schedule_metrics.json` (`python tests/golden/record.py`) holds 10 steps of the
embedded default with staleness bound 0, run on one Ray node. Rerun here by the user's command
on a cluster of two nodes (tests/two_nodes.py: the learners and the reward pool on one, both
generator replicas on the other, every weight sync across them), the same config must give the
same per-step metrics, bit for bit: reward, accuracy, lengths, entropy, loss, gradient norm,
covariance and kernel-weight statistics, and the same held-out evaluations. So the numbers stay
put, and a run across nodes trains what a run on one node trains. (tests/test_multinode.py
checks the same run's placement and stores.)

History: the first file was recorded by commit ebb9699's two trainers (sync, and async with
bound 0); the one scheduler reproduced both bit for bit (commit 7e201f7), and so did the
chunked-logits learner. The file was re-recorded when generation moved to vLLM's async engine
with mixed per-prompt seeds, which changes the samples on purpose, and again when the
generator pool began to hold work for a replica still loading weights (each replica's engine
now batches half of a synchronous step's prompts: other batches, other floating-point sums),
and again when the learner's output head began to run on response tokens only (its weight
gradient sums over fewer positions: step 1 still matched bit for bit, step 2 differed in the
4th digit of a 3e-7 log-prob mismatch mean), and again when the learner's defaults became the
split by tokens and shared prompts (a group's prompt run once per micro-batch: other batch
shapes, other sums; the old file still matched bit for bit on the recording machine just
before); those files were recorded on an AVX512 machine (the file's `machine` and
`recorded_by`).

Bit equality needs the same floating-point kernels and the same starting policy: the golden
file names the CPU, the torch build and the policy's sha256. On another machine (whose own
policy build differs) the comparison would say nothing, and the test is skipped saying why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "golden"))
from record import RUNS, machine  # noqa: E402

from cagrpo_ray.metrics.jsonl import read_metrics  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.preset]

GOLDEN = HERE / "golden" / "schedule_metrics.json"
# Keys that measure time or depend on it; everything else must be equal. data/cursor counts
# the prompts handed to generators when the step was logged, which depends on whether the
# replicas had finished loading the new weights by then.
TIMED = ("time/", "throughput/", "sync/", "generators/idle_fraction", "learner/time/")
SCHEDULE = ("data/cursor",)
REQUIRED = (
    "reward/mean",
    "accuracy/train",
    "response/length_mean",
    "entropy/mean",
    "policy/loss",
    "loss/total",
    "learner/grad_norm",
    "cov/std",
    "cov/pos_1pct",
    "cagrpo/weight_min",
    "cagrpo/weight_mean",
    "logprob/mismatch_mean",
)


def deterministic(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMED) and k not in SCHEDULE}


@pytest.fixture(scope="module")
def golden():
    recorded = json.loads(GOLDEN.read_text())
    here = machine()
    if here != recorded["machine"]:
        pytest.skip(
            f"the golden metrics were recorded on {recorded['machine']}; this is {here}: "
            "bit equality is only defined on the same CPU, torch build and starting policy"
        )
    return recorded


@pytest.fixture(scope="module")
def rerun(golden, golden_run_on_two_nodes):
    run = golden_run_on_two_nodes
    assert run["status"] == 0, run["console"][-4000:]
    got = {"steps": read_metrics(run["run_dir"] / "metrics.jsonl")}
    for phase in ("eval_before", "eval_after"):
        got[phase] = {k: v for k, v in run["summary"][phase].items() if k != "per_prompt"}
    return {"runs": {"bound0": got}}


@pytest.mark.parametrize("name", list(RUNS))
def test_per_step_metrics_are_bit_for_bit_the_golden_ones(golden, rerun, name):
    want, got = golden["runs"][name], rerun["runs"][name]
    assert [r["step"] for r in got["steps"]] == [r["step"] for r in want["steps"]]
    for old, new in zip(want["steps"], got["steps"], strict=True):
        old, new = deterministic(old), deterministic(new)
        for key in REQUIRED:
            assert key in old and key in new, key
        shared = sorted(set(old) & set(new))
        differing = {k: (old[k], new[k]) for k in shared if old[k] != new[k]}
        assert not differing, f"step {old['step']}: {differing}"
    for phase in ("eval_before", "eval_after"):
        assert got[phase] == want[phase], phase
