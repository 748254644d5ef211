"""A real run (Ray, vLLM, DeepSpeed on the CPU) with CA-GRPO's kernel width under the entropy
controller, evaluated at several temperatures and on a harder held-out split.

The kappa every step trained with (metric cagrpo/kappa) must be the controller's rule replayed
on the entropies the learner logged; the checkpoint must carry the controller's state, and a
scheduler restored from it must continue with the same kappa. Evaluation must report greedy and
T=0.7 results and the harder split's, whose prompts have more terms than any training prompt.
"""

from __future__ import annotations

import json

import pytest
import ray

from cagrpo_ray.algo.controllers import KappaController
from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.scheduler import Scheduler
from cagrpo_ray.trainer import STATE_FILE, Trainer

pytestmark = pytest.mark.integration

BAND, RATE = (0.995, 1.005), 0.5  # narrow, so that kappa moves within a few steps


@pytest.fixture(scope="module")
def controlled_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("controlled")
    config = load_config(
        "configs/cpu-tiny.yaml",
        [
            f"run.output_dir={tmp_path}",
            "run.name=controlled",
            "run.steps=4",
            "run.checkpoint_every=0",
            "run.save_policy=never",
            "data.eval_size=8",
            "eval.samples=2",
            "eval.temperatures=[0.7, 0]",
            "eval.hard_config={min_terms: 5, max_terms: 6}",
            "eval.hard_size=8",
            "metrics.enabled=false",
            "metrics.inspect_every=0",
            "algorithm.kappa_control=entropy",
            f"algorithm.kappa_entropy_band=[{BAND[0]}, {BAND[1]}]",
            f"algorithm.kappa_rate={RATE}",
        ],
    )
    ray.init(num_cpus=3, include_dashboard=False)
    trainer = Trainer(config)
    try:
        summary = trainer.run()
    finally:
        ray.shutdown()
    return config, trainer, summary


def test_kappa_is_the_controllers_rule_on_the_logged_entropies(controlled_run):
    config, trainer, _ = controlled_run
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    replay = KappaController(1.0, BAND, RATE)
    for record in records:
        assert record["cagrpo/kappa"] == pytest.approx(replay.kappa, rel=1e-12)
        replay.update(record["entropy/mean"])
    assert len({r["cagrpo/kappa"] for r in records}) > 1  # the narrow band made it move

    # the final checkpoint carries the controller; a restored scheduler continues with it
    state = json.loads((trainer.ckpt_root / "step_000004" / STATE_FILE).read_text())
    assert KappaController.from_state(state["kappa_controller"]).state() == replay.state()
    restored = Scheduler(config, *[None] * 8)
    restored.restore(state)
    assert restored.kappa_controller.state() == replay.state()


def test_evaluation_at_each_temperature_and_on_the_harder_split(controlled_run):
    _, trainer, summary = controlled_run
    after = summary["eval_after"]
    for prefix in ("", "hard/"):
        for t in ("", "T0.7/", "T0/"):
            value = after[f"{prefix}{t}pass@1"]
            assert 0.0 <= value <= 1.0, (prefix, t)
        assert after[f"{prefix}T0.7/num_prompts"] == 8
        assert f"{prefix}T0/pass@2" not in after  # greedy: one sample a prompt
        assert f"{prefix}T0.7/pass@2" in after
    assert all(item.metadata["num_terms"] >= 5 for item in trainer.hard_items)
    assert all(item.metadata["num_terms"] <= 4 for item in trainer.eval_items)
    assert "T0/pass@1" in summary["eval_before"] and "hard/T0/pass@1" in summary["eval_before"]
