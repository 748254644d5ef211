"""A real run (Ray, vLLM, DeepSpeed on the CPU) with CA-GRPO's kernel width under the entropy
controller, evaluated at several temperatures and on a harder held-out split.

The kappa every step trained with (metric cagrpo/kappa) must be the controller's rule replayed
on the entropies the learner logged; the checkpoint must carry the controller's state, and the
schedule restored from it continues at its step. Evaluation must report greedy and T=0.7
results and the harder split's, whose prompts have more terms than any training prompt.
"""

from __future__ import annotations

import json

import pytest
from short_run import CONFIG, EVAL_SIZE, HARD_SIZE, KAPPA_BAND, KAPPA_RATE, STEPS

from cagrpo_ray.algo.controllers import KappaController
from cagrpo_ray.algo.recipe import Recipe
from cagrpo_ray.config import load_config
from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.metrics.jsonl import read_metrics
from cagrpo_ray.schedule import STATE_FILE, Schedule, ScheduleSettings

pytestmark = [pytest.mark.integration, pytest.mark.preset]


@pytest.fixture(scope="module")
def controlled_run(short_run):
    """The session's short run (tests/short_run.py), with its config and summary, and a Trainer
    of that config (not run) for the held-out splits it evaluated on."""
    assert short_run.returncode == 0, short_run.console[-4000:]
    config = load_config(CONFIG, short_run.overrides)
    summary = json.loads((short_run.run_dir / "summary.json").read_text())
    return config, Trainer(config), summary


def test_kappa_is_the_controllers_rule_on_the_logged_entropies(controlled_run):
    config, trainer, _ = controlled_run
    records = read_metrics(trainer.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    replay = KappaController(1.0, KAPPA_BAND, KAPPA_RATE)
    for record in records:
        assert record["cagrpo/kappa"] == pytest.approx(replay.kappa, rel=1e-12)
        replay.update(record["entropy/mean"])
    assert len({r["cagrpo/kappa"] for r in records}) > 1  # the narrow band made it move

    # the final checkpoint carries the controller; a schedule and a recipe restored from it
    # continue with it
    checkpoint = trainer.ckpt_root / f"step_{STEPS:06d}"
    state = json.loads((checkpoint / STATE_FILE).read_text())
    saved = state["controllers"]["kappa_entropy"]
    assert KappaController.from_state(saved).state() == replay.state()
    r = config.rollout
    recipe = Recipe(config.algorithm.recipe_spec(r.group_size, r.max_tokens))
    limit = recipe.groups_assessed_limit(r.prompts_per_step)
    restored = Schedule(ScheduleSettings.from_config(config, config.data.train_size, limit))
    assert restored.load(checkpoint) == state and restored.step == STEPS
    recipe.restore(state["controllers"])
    assert recipe.controllers["kappa_entropy"].state() == replay.state()


def test_evaluation_at_each_temperature_and_on_the_harder_split(controlled_run):
    _, trainer, summary = controlled_run
    trainer.train_source, trainer.eval_items = trainer._sources()
    trainer.hard_items = trainer._hard_items()
    after = summary["eval_after"]
    for prefix in ("", "hard/"):
        for t in ("", "T0.7/", "T0/"):
            value = after[f"{prefix}{t}pass@1"]
            assert 0.0 <= value <= 1.0, (prefix, t)
        assert after[f"{prefix}T0.7/num_prompts"] == (EVAL_SIZE if not prefix else HARD_SIZE)
        assert f"{prefix}T0/pass@2" not in after  # greedy: one sample a prompt
        assert f"{prefix}T0.7/pass@2" in after
    assert all(item.metadata["num_terms"] >= 5 for item in trainer.hard_items)
    assert all(item.metadata["num_terms"] <= 4 for item in trainer.eval_items)
    assert "T0/pass@1" in summary["eval_before"] and "hard/T0/pass@1" in summary["eval_before"]
