"""A learner rank killed mid-run is recovered inside the run, and the run goes on as if
nothing had happened.

One run of `configs/cpu-tiny.yaml` (the chain_sum preset, 2 vLLM generator replicas, 2
DeepSpeed learner ranks, staleness bound 0) of STEPS steps with a checkpoint every
CHECKPOINT_EVERY. While the learner trains step KILL_IN, learner rank 1's process gets
SIGKILL. The run must stop both ranks (rank 0 would otherwise wait in a collective), build a
new learner group from the checkpoint, rewind the schedule to it, give the generators, which
stay up, the checkpoint's weights through a new sync group, and finish: `learner/restarts` 1,
`generators/restarts` 0, every replica serving the last version.

Up to the kill the run is an uninterrupted one; the steps it trained after its checkpoint
are trained again after the recovery and must give the same per-step metrics, metric for
metric (tests/test_train.py's DETERMINISTIC keys, with which it checks a resumed run against
an uninterrupted one): the same weights, optimizer state, prompts, seeds and generator
weights after the rewind.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray
from test_train import DETERMINISTIC, running

from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.preset]

STEPS, CHECKPOINT_EVERY, KILL_IN = 6, 3, 6  # steps 4 and 5 are trained twice


def overrides(tmp_path) -> list[str]:
    return [
        "model.path=chain_sum",
        f"run.output_dir={tmp_path}",
        "run.name=recovered",
        f"run.steps={STEPS}",
        f"run.checkpoint_every={CHECKPOINT_EVERY}",
        "run.keep_checkpoints=4",
        "rollout.enforce_eager=true",
        "rollout.prompts_per_step=8",
        "data.eval_size=8",
        "eval.samples=1",
        "metrics.port=0",
        "metrics.inspect_every=0",
        "sync.timeout_s=20",
    ]


class KillingTrainer(Trainer):
    """A Trainer that SIGKILLs learner rank 1's process right after learner step `kill_in`
    was submitted, and records every step it logs, the fault, and the generators' state when
    the run ends."""

    def __init__(self, config, kill_in: int):
        super().__init__(config)
        self.kill_in = kill_in
        self.logged: list[dict] = []  # each step's metrics as logged, repeated steps too
        self.fault: dict = {}
        self.at_close: dict = {}

    def setup(self):
        super().setup()
        group = self.learners
        submit = group.submit_train_step

        def submit_then_kill(*args, **kwargs):
            if self.fault or self.step + 1 != self.kill_in:
                return submit(*args, **kwargs)
            pids = ray.get([a.apply.remote(lambda learner: os.getpid()) for a in group.actors])
            refs = submit(*args, **kwargs)
            os.kill(pids[1], signal.SIGKILL)
            self.fault.update(step=self.step + 1, at=time.monotonic())
            self.fault["ranks"] = [psutil.Process(pid) for pid in pids]
            return refs

        group.submit_train_step = submit_then_kill

    def _recover_learners(self, lost):
        self.fault.update(error=lost, failed_at=self.step)
        super()._recover_learners(lost)
        self.fault.update(recovered_at=time.monotonic(), resumed_from=self.step)

    def _log_step(self, metrics):
        super()._log_step(metrics)
        self.logged.append({"step": self.step, **metrics})

    def close(self):
        if self.pool is not None and self.scheduler is not None:
            self.at_close["generator_restarts"] = self.pool.restarts
            self.at_close["versions"] = ray.get(
                [g.policy_version.remote() for g in self.pool.actors]
            )
            self.at_close["exported_restarts"] = self.exporter.registry.get_sample_value(
                "cagrpo_learner_restarts_total", {"run": self.config.run.name}
            )
        super().close()


@pytest.fixture(scope="module")
def recovered_run(tmp_path_factory, shared_ray):
    tmp_path = tmp_path_factory.mktemp("recovery")
    trainer = KillingTrainer(load_config("configs/cpu-tiny.yaml", overrides(tmp_path)), KILL_IN)
    started = time.monotonic()
    summary = trainer.run()
    seconds = time.monotonic() - started
    fault = trainer.fault
    print(
        f"\nfault: learner rank 1 SIGKILLed while training step {fault['step']}; recovered "
        f"from step {fault['resumed_from']} in {fault['recovered_at'] - fault['at']:.1f} s "
        f"(kill to the new group serving), {fault['failed_at'] - fault['resumed_from']} "
        f"trained steps repeated; the whole run {seconds:.0f} s"
    )
    return trainer, summary, tmp_path / "recovered"


def test_the_run_recovers_the_lost_rank_and_finishes(recovered_run):
    trainer, summary, run_dir = recovered_run
    fault = trainer.fault
    assert fault["step"] == KILL_IN and "error" in fault, "the rank was not killed as planned"
    error = fault["error"]
    assert error.lost and error.rank == 1, error  # named the killed rank, not the survivor
    assert fault["resumed_from"] == CHECKPOINT_EVERY  # the latest checkpoint before the kill
    assert summary["final_step"] == STEPS and "stopped_at" not in summary
    assert "eval_after" in summary
    # both old ranks are gone: the survivor, stuck in a collective, was stopped too
    left = [p.pid for p in fault["ranks"] if running(p)]
    assert not left, f"processes of the lost learner group still run: {left}"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none lost, none twice
    for r in records:
        assert r["learner/restarts"] == (0 if r["step"] <= CHECKPOINT_EVERY else 1), r["step"]
        assert r["generators/restarts"] == 0
        assert r["staleness/max"] == 0
    assert trainer.at_close["exported_restarts"] == 1.0
    # the generators were not restarted, and serve the last version
    assert trainer.at_close["generator_restarts"] == 0
    assert trainer.at_close["versions"] == [STEPS, STEPS]


def test_the_steps_after_the_recovery_repeat_the_uninterrupted_ones(recovered_run):
    trainer, _, run_dir = recovered_run
    before = {}  # the first time each step was logged: the run up to the kill, uninterrupted
    for record in trainer.logged:
        before.setdefault(record["step"], record)
    after = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    repeated = range(CHECKPOINT_EVERY + 1, KILL_IN)
    assert [r["step"] for r in trainer.logged] == [*range(1, KILL_IN), *repeated, KILL_IN]
    for step in repeated:
        assert before[step]["learner/restarts"] == 0 and after[step]["learner/restarts"] == 1
        for key in DETERMINISTIC:
            assert after[step][key] == pytest.approx(before[step][key], rel=1e-4, abs=1e-6), (
                f"step {step} {key}: after the recovery {after[step][key]}, "
                f"uninterrupted {before[step][key]}"
            )
