"""When a lost learner rank is recovered inside the run and when the run stops instead
(`cagrpo_ray/learner/restarts.py`), the config key that bounds it, the counter the run
reports, and the exit status and message of a run that ran out of recoveries.
tests/test_chaos.py kills a real learner rank mid-run."""

from __future__ import annotations

import pytest

from cagrpo_ray.config import ConfigError, load_config
from cagrpo_ray.learner.group import LearnerGroupError
from cagrpo_ray.learner.restarts import LearnerLostError, LearnerRestarts
from cagrpo_ray.metrics.prometheus import PrometheusExporter

pytestmark = pytest.mark.unit


def lost(rank: int = 1) -> LearnerGroupError:
    return LearnerGroupError(f"learner rank {rank} died during train_step()", rank, lost=True)


@pytest.mark.parametrize("max_restarts", [0, 1, 3])
def test_a_lost_rank_is_recovered_max_restarts_times_then_the_run_stops(max_restarts):
    restarts = LearnerRestarts(max_restarts)
    for step in range(max_restarts):
        restarts.admit(lost(), step=step + 4, checkpoint="step_000004")
        assert restarts.count == step + 1
    with pytest.raises(LearnerLostError) as stopped:
        restarts.admit(lost(rank=1), step=9, checkpoint="step_000008")
    message = str(stopped.value)
    assert "learner rank 1 was lost after step 9" in message
    if max_restarts:
        assert f"rebuilt {max_restarts} time" in message
        assert f"as often as run.max_restarts ({max_restarts}) allows" in message
    else:
        assert "run.max_restarts is 0, so the run stops" in message
    assert "step_000008, is intact" in message and "--resume auto" in message
    assert "died during train_step()" in message  # the group's own error, with its cause
    assert restarts.count == max_restarts  # the loss that stops the run is not a recovery


def test_a_loss_before_the_first_checkpoint_says_there_is_none():
    with pytest.raises(LearnerLostError, match="it has no checkpoint yet"):
        LearnerRestarts(0).admit(lost(), step=1, checkpoint=None)


def test_a_rank_that_raised_is_not_recovered():
    """A rank that raised (a bug, a bad batch) would fail the same step again: its error
    stops the run as it is, and no recovery is counted."""
    restarts = LearnerRestarts(3)
    failed = LearnerGroupError("learner rank 0 failed during train_step(); Cause: ValueError", 0)
    with pytest.raises(LearnerGroupError) as raised:
        restarts.admit(failed, step=2, checkpoint="step_000002")
    assert raised.value is failed and restarts.count == 0


def test_max_restarts_defaults_to_3_and_must_not_be_negative():
    assert load_config("configs/cpu-tiny.yaml").run.max_restarts == 3
    assert load_config("configs/cpu-tiny.yaml", ["run.max_restarts=0"]).run.max_restarts == 0
    with pytest.raises(ConfigError, match="max_restarts"):
        load_config("configs/cpu-tiny.yaml", ["run.max_restarts=-1"])
    with pytest.raises(ConfigError, match="max_restarts"):  # a misspelt key lists the right one
        load_config("configs/cpu-tiny.yaml", ["run.max_restart=2"])


def test_the_restart_counter_is_a_prometheus_counter_of_recoveries():
    exporter = PrometheusExporter("r")
    for step, count in enumerate([0, 0, 1, 1, 2], start=1):
        exporter.observe_step(step, {"learner/restarts": count})
    value = exporter.registry.get_sample_value("cagrpo_learner_restarts_total", {"run": "r"})
    assert value == 2.0


def test_a_run_out_of_recoveries_exits_1_with_one_line_naming_the_rank(monkeypatch, capsys):
    import cagrpo_ray.api
    import cagrpo_ray.run as command

    def out_of_recoveries(config, resume):
        LearnerRestarts(0).admit(lost(rank=1), step=7, checkpoint="step_000006")

    monkeypatch.setattr(cagrpo_ray.api, "run_training", out_of_recoveries)
    assert command.main(["--config", "configs/cpu-tiny.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: learner rank 1 was lost after step 7")
    assert "Traceback" not in err
