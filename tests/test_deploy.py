"""deploy/: the Prometheus scrape config passes promtool, the Grafana provisioning points at the
dashboard, and every series the dashboard queries is one the exporter really exports; the pods'
preStop script (deploy/stop_ray_jobs.py) stops only active jobs and waits for them."""

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

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = [pytest.mark.unit, pytest.mark.clock]

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


# -------------------------------------------------- the pods' preStop script (k8s/, deploy/)


def load_stop_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("stop_ray_jobs", DEPLOY / "stop_ray_jobs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RecordingJobClient:
    """The part of Ray's JobSubmissionClient the script uses; a job stops `polls` status
    reads after it was asked to (a real head: tests/test_token_auth.py)."""

    def __init__(self, statuses: dict[str, str], polls: int):
        self.statuses, self.polls, self.stopped, self.reads = dict(statuses), polls, [], 0

    def list_jobs(self):
        from types import SimpleNamespace

        return [SimpleNamespace(submission_id=s, status=v) for s, v in self.statuses.items()]

    def stop_job(self, submission_id):
        self.stopped.append(submission_id)

    def get_job_status(self, submission_id):
        self.reads += 1
        if submission_id in self.stopped and self.reads > self.polls:
            self.statuses[submission_id] = "STOPPED"
        return self.statuses[submission_id]


def test_the_stop_script_stops_only_active_jobs_and_waits_for_them():
    script = load_stop_script()
    statuses = {"a": "RUNNING", "b": "SUCCEEDED", "c": "PENDING", "d": "FAILED"}
    client = RecordingJobClient(statuses, polls=3)
    assert script.stop_jobs(client, timeout_s=30, poll_s=0.001) == 0
    assert client.stopped == ["a", "c"]
    assert client.statuses["a"] == client.statuses["c"] == "STOPPED"
    assert client.reads > 3


def test_the_stop_script_gives_up_at_its_timeout():
    script = load_stop_script()
    client = RecordingJobClient({"a": "RUNNING"}, polls=10**9)
    assert script.stop_jobs(client, timeout_s=0.05, poll_s=0.01) == 1
    assert client.stopped == ["a"]


def test_the_stop_script_reaches_the_head_from_a_worker(monkeypatch):
    script = load_stop_script()
    monkeypatch.setenv("FQ_RAY_IP", "cagrpo-head-svc.team.svc.cluster.local")
    assert script.default_address() == "http://cagrpo-head-svc.team.svc.cluster.local:8265"
    monkeypatch.delenv("FQ_RAY_IP")
    assert script.default_address() == "http://127.0.0.1:8265"
