"""One short run of `make train`'s command that several test modules read (`short_run` in
conftest.py, once a session).

`python -m cagrpo_ray.run --config configs/cpu-tiny.yaml` for a few steps, with every feature
on that a short run can show at once: the entropy controller on CA-GRPO's kernel width (a band
narrow enough that kappa moves), DAPO's dynamic sampling, the token inspector at every step and
served on a free port, the Prometheus exporter, and evaluation at two temperatures and on a
harder split. Its console (stdout and stderr in the order printed), its run directory, and the
inspector's page fetched while the run trained are what the tests get:

- tests/test_console.py: the console holds the project's lines and ends with the table; the
  libraries' output is in one log file per actor;
- tests/test_inspect_run.py: the learner's values of whole groups, the page, the live page;
- tests/test_controlled_run.py: kappa is the controller's rule, the checkpoint carries it, the
  evaluation at each temperature and on the harder split;
- tests/test_dynamic_sampling.py: no batch holds a group without signal.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/cpu-tiny.yaml"
STEPS = 4
PROMPTS = 16
KAPPA_BAND, KAPPA_RATE = (0.995, 1.005), 0.5  # narrow, so that kappa moves within a few steps
INSPECT_GROUPS = 2
EVAL_SIZE = HARD_SIZE = 8


def overrides(out: Path) -> list[str]:
    return [
        f"run.output_dir={out}",
        "run.name=short",
        f"run.steps={STEPS}",
        "run.checkpoint_every=0",  # the final checkpoint only
        f"rollout.prompts_per_step={PROMPTS}",
        f"data.eval_size={EVAL_SIZE}",
        "eval.samples=2",
        "eval.temperatures=[0.7, 0]",
        "eval.hard_config={min_terms: 5, max_terms: 6}",
        f"eval.hard_size={HARD_SIZE}",
        "metrics.port=0",
        "metrics.inspect_every=1",
        f"metrics.inspect_groups={INSPECT_GROUPS}",
        "metrics.inspect_port=0",
        "algorithm.kappa_control=entropy",
        f"algorithm.kappa_entropy_band=[{KAPPA_BAND[0]}, {KAPPA_BAND[1]}]",
        f"algorithm.kappa_rate={KAPPA_RATE}",
        "algorithm.dynamic_sampling=true",
    ]


@dataclasses.dataclass
class ShortRun:
    returncode: int
    console: str  # everything the command printed
    run_dir: Path
    overrides: list[str]
    live: dict  # {"url", "page"}: the inspector's page, fetched while the run trained


def run_short(out: Path, timeout_s: float = 900) -> ShortRun:
    """The command, watched: once the inspector has a step, its page is fetched (live)."""
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", CONFIG]
    for item in overrides(out):
        command += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster
    env["PYTHONUNBUFFERED"] = "1"
    console_file = out / "console.txt"
    run_dir, live = out / "short", {}
    with console_file.open("w") as console:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=console, stderr=subprocess.STDOUT, text=True
        )
        watcher = threading.Thread(
            target=_watch, args=(process, console_file, run_dir, live), daemon=True
        )
        watcher.start()
        try:
            process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        watcher.join(timeout=60)
    return ShortRun(process.returncode, console_file.read_text(), run_dir, overrides(out), live)


def _watch(process, console_file: Path, run_dir: Path, live: dict) -> None:
    url = None
    while process.poll() is None:
        if url is None:
            found = re.search(r"token inspector at (http://\S+)", console_file.read_text())
            url = found.group(1) if found else None
        if url is not None and list((run_dir / "inspect").glob("step_*.parquet")):
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    live["page"], live["url"] = response.read().decode(), url
                return
            except OSError as error:  # recorded; the test says what it got
                live["error"] = repr(error)
        time.sleep(0.2)
