"""Ray token authentication and the pods' preStop hook, against a real Ray head on loopback.

The head starts as k8s/ starts its heads (KubeRay's `authOptions.mode: token` sets
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret) and as docs/deployment.md's `ray start`
recipe does. `ray job submit` without the token, or with a wrong one, is refused; with it, the
job runs. Then deploy/stop_ray_jobs.py, the preStop hook of every Ray pod, stops a running job
as `ray job stop` does: the job's SIGTERM handler finishes its work past Ray's default 3 s stop
wait (the head's RAY_JOB_STOP_WAIT_TIME_S, as in k8s/, lets it) and the script returns only
once the job has ended; without the token the hook is refused and the job runs on.

The head has its own temp dir and free ports, and is stopped at the end, whatever happens,
and only it (`ray stop` would end every Ray cluster on the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_ray_job import RAY, free_port, stop_cluster, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
STOP_SCRIPT = REPO / "deploy" / "stop_ray_jobs.py"
AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
# Longer than Ray's default stop wait (3 s), shorter than the head's RAY_JOB_STOP_WAIT_TIME_S.
CHECKPOINT_S = 6

# A job that behaves like the trainer on SIGTERM: finish the work in hand, write a
# "checkpoint", exit 0.
GRACEFUL_JOB = f"""
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def stop(signum, frame):
    time.sleep({CHECKPOINT_S})
    out.write_text("checkpoint")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(out.parent / "started").write_text("")
time.sleep(600)
"""


def client_env(home: Path, token: str | None) -> dict:
    """A client's environment: no inherited Ray auth, a HOME without ~/.ray/auth_token, and
    RAY_AUTH_MODE=token with `token` when one is given."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARIABLES}
    env.update(HOME=str(home), PATH=f"{Path(RAY).parent}:{env['PATH']}")
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return env


@pytest.fixture(scope="module")
def token_head():
    """(dashboard address, token, a HOME for clients) of a head with token authentication."""
    temp_dir = tempfile.mkdtemp(prefix="raytok-", dir="/tmp")
    home = Path(temp_dir) / "home"
    home.mkdir()
    token = secrets.token_hex(32)
    env = client_env(home, token)
    env.update(RAY_JOB_STOP_WAIT_TIME_S="60", RAY_process_group_cleanup_enabled="1")
    dashboard = free_port()
    cmd = [
        RAY,
        "start",
        "--head",
        f"--port={free_port()}",
        f"--temp-dir={temp_dir}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--ray-client-server-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--num-cpus=2",
        "--num-gpus=0",
        "--disable-usage-stats",
    ]
    try:
        subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=180)
        yield f"http://127.0.0.1:{dashboard}", token, home
    finally:
        stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(address: str, env: dict, *entrypoint: str, submission_id: str | None = None):
    """`ray job submit`; with a submission id it returns once the job is submitted."""
    cmd = [RAY, "job", "submit", f"--address={address}"]
    if submission_id is not None:
        cmd += [f"--submission-id={submission_id}", "--no-wait"]
    return subprocess.run(
        [*cmd, "--", *entrypoint], env=env, capture_output=True, text=True, timeout=300
    )


def job_status(address: str, env: dict, submission_id: str) -> str:
    """The job's status (PENDING, RUNNING, STOPPED, ...) from the job API, as a client with
    `env` sees it."""
    code = (
        "import sys; from ray.job_submission import JobSubmissionClient; "
        "print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, address, submission_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()[-1]


def test_job_submission_needs_the_token(token_head, tmp_path):
    address, token, home = token_head
    marker = tmp_path / "ran"
    entrypoint = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"]

    refused = submit(address, client_env(home, None), *entrypoint)
    assert refused.returncode != 0
    assert "auth" in (refused.stdout + refused.stderr).lower(), refused.stdout + refused.stderr

    wrong = submit(address, client_env(home, secrets.token_hex(32)), *entrypoint)
    assert wrong.returncode != 0
    assert "auth" in (wrong.stdout + wrong.stderr).lower(), wrong.stdout + wrong.stderr
    assert not marker.exists()

    accepted = submit(address, client_env(home, token), *entrypoint)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert "succeeded" in accepted.stdout.lower(), accepted.stdout
    assert marker.read_text() == "ok"


def test_the_prestop_hook_stops_the_job_and_waits_for_its_checkpoint(token_head, tmp_path):
    address, token, home = token_head
    checkpoint = tmp_path / "checkpoint"
    script = tmp_path / "job.py"
    script.write_text(GRACEFUL_JOB)
    with_token = client_env(home, token)
    submission_id = f"graceful-{secrets.token_hex(4)}"
    entrypoint = [sys.executable, str(script), str(checkpoint)]
    submitted = submit(address, with_token, *entrypoint, submission_id=submission_id)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    wait_for(lambda: (tmp_path / "started").exists(), 120, "the job to start")

    hook = [sys.executable, str(STOP_SCRIPT), f"--address={address}", "--timeout=120"]
    refused = subprocess.run(
        hook, env=client_env(home, None), capture_output=True, text=True, timeout=180
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert job_status(address, with_token, submission_id) == "RUNNING"

    start = time.monotonic()
    stopped = subprocess.run(hook, env=with_token, capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - start
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"stopping Ray job {submission_id}" in stopped.stdout
    # The hook returned only after the job's handler had written its checkpoint.
    assert checkpoint.read_text() == "checkpoint"
    assert elapsed >= CHECKPOINT_S - 1, elapsed
    assert job_status(address, with_token, submission_id) == "STOPPED"

    # Nothing left to stop: the hook returns at once.
    again = subprocess.run(hook, env=with_token, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "0 Ray job(s) stopped" in again.stdout, again.stdout
