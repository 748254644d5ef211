"""deploy/: the Prometheus scrape config passes promtool, the Grafana provisioning points at the
dashboard, and every series the dashboard queries is one the exporter really exports."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cagrpo_ray.metrics.prometheus import METRIC_NAMES, TRAINER_KEYS, PrometheusExporter

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "cagrpo_ray.json"

# PromQL words that are not metric names (functions are recognised by the "(" after them).
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (with Grafana's $variables in it)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        word, call = match.groups()
        if not call and word.lower() not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def test_promql_metric_names_parser():
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{run="$run", x=~"b|c"}[5m])))'
        " / ignoring(phase) b_total offset 5m + on() group_left c * 1e3 + d[$__rate_interval]"
    )
    assert promql_metric_names(expr) == {"a_bucket", "b_total", "c", "d"}


def exported_sample_names() -> set[str]:
    """Sample names in the exporter's output after a step that sets every metric."""
    exporter = PrometheusExporter("deploy-test")
    step = {key: 1.0 for key in TRAINER_KEYS} | {"staleness/values": [0, 1]}
    exporter.observe_step(1, step)
    text = generate_latest(exporter.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_every_dashboard_metric_is_exported_and_every_metric_is_shown():
    exported = exported_sample_names()
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    used = set()
    for expr in exprs:
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr)
        names = {match.group(1)} if match else promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"dashboard queries {sorted(unknown)} the exporter does not export"
        used |= names
    shown = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert set(METRIC_NAMES) - shown == set(), "exported but not on the dashboard"


def test_dashboard_panels_filter_by_the_run_variable_and_use_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "run", "inspector"]
    # the token inspector: a dashboard link to the URL the driver serves it at
    (link,) = dashboard["links"]
    assert link["url"] == "${inspector}" and link["targetBlank"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), f"panel {panel['title']!r} has no description"
        for target in panel["targets"]:
            for selector in re.findall(r"cagrpo_\w+(\{[^}]*\})?", target["expr"]):
                assert selector == '{run="$run"}', (panel["title"], target["expr"])
    phases = next(p for p in dashboard["panels"] if p["title"] == "Step time by phase")
    assert phases["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"


def test_grafana_provisioning_points_at_the_datasource_and_the_dashboards():
    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    assert datasources["apiVersion"] == 1
    [source] = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://localhost:9090"  # Prometheus' default listen address

    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/cagrpo.yaml").read_text())
    assert providers["apiVersion"] == 1
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    # The documented Grafana command mounts the dashboards folder exactly there.
    mount = f'"$PWD/deploy/grafana/dashboards:{path}:ro"'
    assert mount in (DEPLOY / "README.md").read_text()
    assert list((DEPLOY / "grafana/dashboards").glob("*.json")) == [DASHBOARD]


def test_prometheus_config_scrapes_the_exporter_and_ray():
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets == {"cagrpo": ["localhost:9400"], "ray": ["localhost:8080"]}


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing on CI: apt-get install -y prometheus")
        pytest.skip("promtool not installed (apt-get install -y prometheus)")
    result = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
