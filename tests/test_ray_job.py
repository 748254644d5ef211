"""`ray job submit` against a real Ray head on loopback, scraped by a real Prometheus.

The first job trains until `ray job stop` ends it; it must leave a checkpoint. The second job
resumes from that checkpoint and runs to completion, while Debian's `prometheus` scrapes the
driver's exporter; the entropy and throughput series are then read back through Prometheus's
HTTP API. The head started here is stopped at the end, and only it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cagrpo_ray.local_cluster import kill_processes

pytestmark = [pytest.mark.integration, pytest.mark.preset]

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def ray_head():
    # Token auth is switched on by an existing ~/.ray/auth_token; a loopback head needs none.
    env = dict(
        os.environ,
        PATH=f"{BIN}:{os.environ['PATH']}",
        RAY_JOB_STOP_WAIT_TIME_S="120",
        RAY_AUTH_MODE="disabled",
        RAY_process_group_cleanup_enabled="1",  # as the KubeRay manifests start theirs
    )
    env.pop("RAY_ADDRESS", None)
    # A temp dir of its own (short: Ray's socket paths must fit 107 bytes): the head's address
    # is written there, not to /tmp/ray, so a local `ray.init()` elsewhere on the machine (a
    # run or a study beside the tests) starts its own cluster instead of joining this one.
    temp_dir = tempfile.mkdtemp(prefix="rayjob-", dir="/tmp")
    dashboard = free_port()
    cmd = [
        RAY,
        "start",
        "--head",
        f"--port={free_port()}",
        f"--temp-dir={temp_dir}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        # the job API asks the head's agent, whose default port another cluster here may hold
        f"--dashboard-agent-listen-port={free_port()}",
        "--num-cpus=3",
        "--disable-usage-stats",
    ]
    try:
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=180)
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        stop_cluster(temp_dir)  # this head alone: `ray stop` would end every cluster here
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_cluster(temp_dir: str) -> None:
    """Kill the processes of the cluster started with `temp_dir` (those naming it on their
    command line: GCS, raylet, dashboard, monitors) and every process under them (workers,
    agents, the jobs' drivers and their engines)."""
    kill_processes(Path(temp_dir))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    from cagrpo_ray.policies.model import random_policy

    return random_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=3)


@pytest.fixture()
def prometheus(tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (.ci/run installs Debian's package)")
        pytest.skip("prometheus is not installed")
    exporter_port, web_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: cagrpo\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{exporter_port}']\n"
    )
    process = subprocess.Popen(
        [
            exe,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{web_port}"
    wait_for(lambda: _get(f"{url}/-/ready") is not None, 60, "prometheus to be ready")
    yield url, exporter_port
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return None


def query(prometheus_url: str, promql: str) -> list:
    text = _get(f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert text is not None, f"prometheus did not answer {promql}"
    body = json.loads(text)
    assert body["status"] == "success", body
    return body["data"]["result"]


def job(address: str, env: dict, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RAY, "job", args[0], "--address", address, *args[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def entrypoint(policy: Path, out: Path, steps: int, metrics_port: int, resume: bool) -> list[str]:
    """The job's command line, as separate arguments (the CLI joins them for the shell)."""
    sets = [
        f"model.path={policy}",
        f"run.output_dir={out}",
        "run.name=job",
        f"run.steps={steps}",
        "run.checkpoint_every=0",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "data.train_size=500",
        "data.eval_size=8",
        "eval.samples=2",
        f"metrics.port={metrics_port}",
        "rollout.enforce_eager=true",  # vLLM starts in half the time; what is tested is the job
        # One replica: a job's engine is the same as a local run's; several replicas and their
        # sync are tested by tests/test_train.py and the short run. Both learner ranks stay:
        # DeepSpeed's comm extension is built and loaded in a job's environment too.
        "rollout.num_generators=1",
    ]
    # The interpreter running the tests, so that the job sees the same installed packages.
    # configs/async.yaml is what users submit (and the RayJob's entrypoint).
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", "configs/async.yaml"]
    command += [arg for s in sets for arg in ("--set", s)]
    return command + (["--resume"] if resume else [])


def test_stop_then_resume_as_jobs_with_prometheus_watching(ray_head, policy, prometheus, tmp_path):
    address, env = ray_head
    prometheus_url, exporter_port = prometheus
    out = tmp_path / "runs"
    metrics_file = out / "job" / "metrics.jsonl"

    first = job(
        address,
        env,
        "submit",
        "--no-wait",
        "--submission-id",
        "first",
        "--working-dir",
        ".",
        "--",
        *entrypoint(policy, out, 1000, exporter_port, resume=False),
    )
    assert first.returncode == 0, first.stderr

    def third_step_or_failure():
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
            return True
        # the job API's own answer (what `ray job status` prints), without a CLI process that
        # imports Ray every poll on the cores the job runs on
        info = json.loads(_get(f"{address}/api/jobs/first") or '{"status": "UNKNOWN"}')
        assert info["status"] != "FAILED", job(address, env, "logs", "first").stdout[-5000:]
        return False

    wait_for(third_step_or_failure, 600, "the first job's third step", interval_s=2)
    stop = job(address, env, "stop", "first", timeout=300)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    status = job(address, env, "status", "first").stdout
    assert "stopped" in status.lower(), status
    logs = job(address, env, "logs", "first").stdout
    assert "checkpoint written" in logs, logs[-3000:]
    latest = (out / "job" / "checkpoints" / "latest").read_text().strip()
    state = json.loads((out / "job" / "checkpoints" / latest / "trainer_state.json").read_text())
    stopped_at = state["step"]
    assert stopped_at >= 3

    second = job(
        address,
        env,
        "submit",
        "--submission-id",
        "second",
        "--working-dir",
        ".",
        "--",
        *entrypoint(policy, out, stopped_at + 3, exporter_port, resume=True),
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "succeeded" in job(address, env, "status", "second").stdout.lower()
    assert "resumed from" in second.stdout
    summary = json.loads((out / "job" / "summary.json").read_text())
    assert summary["final_step"] == stopped_at + 3
    # rollout.enforce_eager reached the engines (vLLM logs its config)
    assert "enforce_eager=True" in (out / "job" / "logs" / "generator-0.log").read_text()

    entropy = query(prometheus_url, "max_over_time(cagrpo_policy_entropy_nats[30m])")
    tokens = query(prometheus_url, "max_over_time(cagrpo_generated_tokens_per_second[30m])")
    steps = query(prometheus_url, "max_over_time(cagrpo_learner_step[30m])")
    assert entropy and 0 < float(entropy[0]["value"][1]) < 10  # nats, a 265-token vocabulary
    assert tokens and float(tokens[0]["value"][1]) > 0
    assert steps and float(steps[0]["value"][1]) == stopped_at + 3
    trained = query(prometheus_url, "max_over_time(cagrpo_sample_staleness_versions_count[30m])")
    assert trained and float(trained[0]["value"][1]) > 0  # the staleness histogram is filled
