"""The driver's Prometheus exporter: names, help, types, labels, updates and the HTTP endpoint."""

import ast
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cagrpo_ray.metrics.prometheus import (
    COVARIANCE_TAILS,
    METRIC_NAMES,
    METRICS,
    TRAINER_KEYS,
    PrometheusExporter,
)

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]

PACKAGE = Path(__file__).parent.parent / "cagrpo_ray"
# Keys the trainer does not put in its per-step dict yet; the exporter is ready for them.
NOT_YET_PRODUCED: set[str] = set()


def every_key(value: float = 0.5) -> dict:
    """One step's dict holding every key the exporter reads."""
    metrics = {key: value for key in TRAINER_KEYS}
    metrics["staleness/values"] = [0, 0, 1, 2, 2, 5]
    return metrics


def exposition(exporter: PrometheusExporter) -> str:
    from prometheus_client import generate_latest

    return generate_latest(exporter.registry).decode()


def samples(exporter: PrometheusExporter) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the registry's text exposition."""
    out = {}
    for family in text_string_to_metric_families(exposition(exporter)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_metric_has_help_type_and_a_sample_after_one_step():
    exporter = PrometheusExporter("r1")
    exporter.observe_step(1, every_key())
    text = exposition(exporter)
    kinds = {"gauge": "gauge", "counter": "counter", "running_total": "counter"}
    kinds["histogram"] = "histogram"
    expected = {"cagrpo_learner_step": "gauge", "cagrpo_learner_steps_total": "counter"}
    expected |= {spec.name: kinds[spec.kind] for spec in METRICS}
    assert set(expected) == set(METRIC_NAMES)
    for name, kind in expected.items():
        help_line = next(line for line in text.splitlines() if line.startswith(f"# HELP {name} "))
        assert len(help_line) > len(f"# HELP {name} ") + 10, help_line
        assert f"# TYPE {name} {kind}\n" in text
        sample = name + ("_count" if kind == "histogram" else "")
        assert any(line.startswith(sample + "{") for line in text.splitlines()), name


def test_names_are_unique_and_only_counters_end_in_total():
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    assert all(name.startswith("cagrpo_") for name in METRIC_NAMES)
    for spec in METRICS:
        assert spec.name.endswith("_total") == (spec.kind in ("counter", "running_total"))


def test_labels_map_trainer_keys_and_carry_the_run():
    exporter = PrometheusExporter("paper-1.5b")
    exporter.observe_step(
        3,
        {
            "time/wait_batch": 4.0,
            "time/sync": 0.25,
            "staleness/max": 2,
            "accuracy/train": 0.4,
            "eval/pass@1": 0.3,
            "cov/pos_0.01pct": 7.5,
            "cov/neg_40pct": -0.1,
            "cagrpo/weight_frac_below_0.5": 0.02,
            "entropy/mean": 0.9,
        },
    )
    got = samples(exporter)
    run = ("run", "paper-1.5b")

    def value(name, **labels):
        return got[(name, tuple(sorted([run, *labels.items()])))]

    assert value("cagrpo_step_phase_seconds", phase="wait_batch") == 4.0
    assert value("cagrpo_step_phase_seconds", phase="sync") == 0.25
    assert value("cagrpo_staleness_versions", stat="max") == 2
    assert value("cagrpo_accuracy_ratio", split="train") == 0.4
    assert value("cagrpo_accuracy_ratio", split="eval") == 0.3
    assert value("cagrpo_token_covariance", quantile="pos_0.01pct") == 7.5
    assert value("cagrpo_token_covariance", quantile="neg_40pct") == -0.1
    assert value("cagrpo_kernel_weight", stat="frac_below_0.5") == 0.02
    assert value("cagrpo_policy_entropy_nats") == 0.9
    assert value("cagrpo_learner_step") == 3
    # Absent keys are not updated: no phase sample was created for reward or train.
    assert ("cagrpo_step_phase_seconds", tuple(sorted([run, ("phase", "train")]))) not in got
    assert all(dict(labels).get("run") == "paper-1.5b" for _, labels in got)


def test_unknown_keys_and_bad_values_are_ignored_and_gauges_keep_their_value():
    exporter = PrometheusExporter("r")
    exporter.observe_step(1, {"reward/mean": 0.5})
    before = samples(exporter)
    exporter.observe_step(
        2,
        {
            "reward/mean": float("nan"),
            "not/a_metric": 1.0,
            "eval/per_prompt": [1, 2],
            "learner/lr": None,
            "learner/grad_norm": "1.0",
            "tokens/generated": float("inf"),
        },
    )
    after = samples(exporter)
    assert after[("cagrpo_reward_mean", (("run", "r"),))] == 0.5
    step_samples = {"cagrpo_learner_step", "cagrpo_learner_steps_total"}
    assert {k for k in after if k[0] not in step_samples} == {
        k for k in before if k[0] not in step_samples
    }


def test_counters_add_increments_and_running_totals_add_their_rise():
    exporter = PrometheusExporter("r")
    for step, (tokens, dropped) in enumerate([(100, 0), (50, 3), (25, 3), (10, 1)], start=1):
        exporter.observe_step(
            step, {"tokens/generated": tokens, "buffer/dropped_stale_groups": dropped}
        )
    got = samples(exporter)
    key = (("run", "r"),)
    assert got[("cagrpo_generated_tokens_total", key)] == 185
    # 0 -> 3 -> 3, then a restarted total at 1 counts as 1 more.
    assert got[("cagrpo_stale_groups_dropped_total", key)] == 4
    assert got[("cagrpo_learner_steps_total", key)] == 4
    assert got[("cagrpo_learner_step", key)] == 4


def test_staleness_histogram_observes_every_sample():
    import numpy as np

    exporter = PrometheusExporter("r")
    exporter.observe_step(1, {"staleness/values": np.array([0, 0, 1, 3])})
    exporter.observe_step(2, {"staleness/values": [2]})
    got = samples(exporter)
    name = "cagrpo_sample_staleness_versions"
    assert got[(name + "_count", (("run", "r"),))] == 5
    assert got[(name + "_sum", (("run", "r"),))] == 6
    assert got[(name + "_bucket", (("le", "0.0"), ("run", "r")))] == 2
    assert got[(name + "_bucket", (("le", "2.0"), ("run", "r")))] == 4


def test_http_endpoint_serves_the_registry_on_a_free_port():
    with PrometheusExporter("http-run", port=0, host="127.0.0.1") as exporter:
        assert exporter.port > 0
        assert exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        exporter.observe_step(7, {"throughput/generated_tokens_per_s": 1234.5})
        with urllib.request.urlopen(exporter.url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            body = response.read().decode()
    assert 'cagrpo_generated_tokens_per_second{run="http-run"} 1234.5' in body
    assert "# HELP cagrpo_generated_tokens_per_second" in body
    with pytest.raises(OSError):
        urllib.request.urlopen(exporter.url, timeout=2)


def string_literals(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_every_key_read_is_one_the_trainer_or_learner_produces():
    """Guards the key contract: a renamed trainer or learner metric must be renamed here too."""
    import torch

    from cagrpo_ray.algo.stats import covariance_quantiles
    from cagrpo_ray.eval.metrics import k_values

    trainer = set().union(
        *(
            string_literals(PACKAGE / path)
            for path in (
                "driver/trainer.py",
                "driver/loop.py",
                "sync/coordinator.py",
                "rollout/batch_metrics.py",
            )
        )
    )
    learner = set().union(
        *(
            string_literals(path)
            for folder in ("learner", "algo")
            for path in sorted((PACKAGE / folder).glob("*.py"))
        )
    )
    # Trainer.train_step files learner metrics without a "/" under "learner/".
    produced = trainer | {k if "/" in k else f"learner/{k}" for k in learner}
    table = covariance_quantiles(torch.arange(16.0).reshape(2, 8), torch.ones(2, 8, dtype=bool))
    assert set(table) == set(COVARIANCE_TAILS)
    produced |= {f"cov/{tail}" for tail in table}
    produced |= {f"eval/pass@{k}" for k in k_values(4)}  # evaluate() under "eval/"
    missing = set(TRAINER_KEYS) - produced - NOT_YET_PRODUCED
    assert not missing, f"the exporter reads keys nobody writes: {sorted(missing)}"
