"""A quiet console with everything kept (`cagrpo_ray/console.py`).

The session's short run of `make train`'s command (tests/short_run.py) prints the project's
lines and ends with the final table, with none of vLLM's, DeepSpeed's or Ray's own lines;
those are in `runs/<name>/logs/`, one file per actor (the generators' holding the output of
vLLM's engine process) and one for the driver. The unit tests check the redirect of one
process's output, the driver's routing of log records, and how a Ray error is matched with its
actor's file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import short_run as short_run_module

from cagrpo_ray.api import final_report
from cagrpo_ray.console import (
    LOG_FILE_ENV,
    actor_env,
    log_dir,
    logs_for_error,
    redirect_output,
    redirected,
)

REPO = Path(__file__).resolve().parent.parent
THIRD_PARTY = (  # lines vLLM, DeepSpeed, Ray and transformers print in a run, per actor
    "Model Runner V2 requires Triton",
    "Triton is not installed",
    "Triton is installed, but",
    "libtcmalloc is not found in LD_PRELOAD",
    "libiomp is not found",
    "does not officially support disabling chunked prefill",
    "Inductor compilation was disabled",
    "Passing raw prompts to InputProcessor is deprecated",
    "Setting accelerator to CPU",
    "Token authentication is enabled",
    "Started a local Ray instance",
    "FutureWarning",
    "Loading weights",
    "Writing model shards",
)
FORWARDED = re.compile(r"^(\x1b\[\d+m)?\((\S+ )?pid=\d+")  # a line Ray forwarded from an actor
PROJECT_RECORD = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) cagrpo_ray[.:]")
ACTORS = ["generator-0", "generator-1", "learner-0", "learner-1", "reward"]


def python(code: str, env: dict | None = None, cwd: Path | None = None):
    """Run `code` in a fresh interpreter (its file descriptors are its own)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


# ----------------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_a_redirected_process_writes_everything_to_its_file_and_warnings_to_the_console(
    tmp_path,
):
    path = tmp_path / "logs" / "generator-0.log"
    result = python(
        """
        import logging, os, subprocess, sys
        from cagrpo_ray.console import redirect_output
        print("before", flush=True)
        redirect_output()
        print("python stdout"); print("python stderr", file=sys.stderr)
        os.write(1, b"native fd 1\\n")
        subprocess.run("echo child stdout; echo child stderr >&2", shell=True)
        log = logging.getLogger("cagrpo_ray.rollout.generator")
        log.info("a stage")
        log.warning("act on this")
        """,
        env={LOG_FILE_ENV: str(path)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\n"
    assert result.stderr.splitlines() == [result.stderr.strip()]  # one line, the warning
    assert "WARNING cagrpo_ray.rollout.generator: act on this" in result.stderr
    assert f"(full output: {path})" in result.stderr
    lines = path.read_text().splitlines()
    assert re.match(r"==== generator-0: pid \d+, ", lines[0])
    for expected in ("python stdout", "python stderr", "native fd 1", "child stdout",
                     "child stderr"):  # fmt: skip
        assert expected in lines
    assert any(line.endswith("INFO cagrpo_ray.rollout.generator: a stage") for line in lines)
    assert any(line.endswith("WARNING cagrpo_ray.rollout.generator: act on this") for line in lines)


@pytest.mark.unit
def test_without_a_log_file_nothing_is_redirected(monkeypatch):
    monkeypatch.delenv(LOG_FILE_ENV, raising=False)
    assert redirect_output() is None

    class Plain:
        """A plain class."""

        def __init__(self, x):
            self.x = x

    wrapped = redirected(Plain)
    assert wrapped(3).x == 3 and issubclass(wrapped, Plain)
    assert wrapped.__name__ == "Plain" and wrapped.__doc__ == Plain.__doc__
    import ray.cloudpickle

    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(wrapped))(4).x == 4  # as Ray ships it


@pytest.mark.unit
def test_actor_env_names_one_absolute_file_per_role(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logs = log_dir(Path("runs") / "r")
    assert logs == tmp_path / "runs" / "r" / "logs"
    assert actor_env(logs, "learner-1") == {LOG_FILE_ENV: str(logs / "learner-1.log")}


@pytest.mark.unit
def test_the_driver_console_shows_the_project_and_errors_the_file_everything(tmp_path):
    result = python(
        """
        import logging, sys, warnings
        from cagrpo_ray.console import configure_driver_logging
        configure_driver_logging("run")
        # DeepSpeed makes its logger when imported (after this), printing to stdout
        deepspeed = logging.getLogger("DeepSpeed")
        deepspeed.propagate = False
        deepspeed.addHandler(logging.StreamHandler(sys.stdout))
        deepspeed.warning("Setting accelerator to CPU.")
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        logging.getLogger("ray.auth").warning("Token authentication is enabled")
        logging.getLogger("transformers.tokenization_utils").warning("a tokenizer note")
        warnings.warn("an old API", FutureWarning)
        logging.getLogger("cagrpo_ray").info("step 1/2 reward=0.5")
        logging.getLogger("cagrpo_ray.sync").warning("resyncing generator replicas [0]")
        logging.getLogger("urllib3").error("a library's error")
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    console = result.stderr.splitlines()
    assert [line.split(" ", 1)[1] for line in console] == [
        "INFO cagrpo_ray: step 1/2 reward=0.5",
        "WARNING cagrpo_ray.sync: resyncing generator replicas [0]",
        "ERROR urllib3: a library's error",
    ]
    kept = (tmp_path / "run" / "logs" / "driver.log").read_text()
    for text in ("Setting accelerator to CPU.", "Started a local Ray instance.",
                 "Token authentication is enabled", "a tokenizer note", "an old API",
                 "step 1/2 reward=0.5", "a library's error"):  # fmt: skip
        assert text in kept


@pytest.mark.unit
def test_a_ray_error_is_matched_with_its_actors_file_by_pid(tmp_path):
    for role, pids in {"generator-0": [111, 333], "generator-1": [222], "driver": [333]}.items():
        parts = [f"==== {role}: pid {pid}, 2026-01-01 00:00:00 ====\nvLLM says\n" for pid in pids]
        (tmp_path / f"{role}.log").write_text("".join(parts))  # a restart appends a part

    class RayTaskError(RuntimeError):
        pass

    task_error = RayTaskError("ray::Generator.generate() (pid=333, ip=10.0.0.1, actor_id=ab)")
    assert logs_for_error(task_error, tmp_path) == [tmp_path / "generator-0.log"]  # restarted
    try:
        try:
            raise RayTaskError("The actor died unexpectedly.\n\tpid: 222\n\tip: 10.0.0.1")
        except RayTaskError as err:
            raise RuntimeError("learner rank 1 died during train_step()") from err
    except RuntimeError as chained:
        assert logs_for_error(chained, tmp_path) == [tmp_path / "generator-1.log"]
    assert logs_for_error(RuntimeError("no pid here"), tmp_path) == []


# ---------------------------------------------------------------------------- integration


@pytest.mark.integration
@pytest.mark.preset
def test_the_console_holds_the_projects_lines_and_ends_with_the_table(short_run):
    run_dir, console = short_run.run_dir, short_run.console
    assert short_run.returncode == 0, console[-4000:]
    for phrase in THIRD_PARTY:
        assert phrase not in console, phrase
    lines = console.splitlines()
    assert not [line for line in lines if FORWARDED.match(line)]  # nothing from an actor
    records = [line for line in lines if re.search(r"\b(DEBUG|INFO|WARNING)\b", line)]
    assert records and all(PROJECT_RECORD.match(line) for line in records), records
    steps = short_run_module.STEPS
    assert sum("INFO cagrpo_ray: step " in line for line in lines) == steps  # one line a step
    summary = json.loads((run_dir / "summary.json").read_text())
    assert console.rstrip("\n").endswith("\n" + final_report(summary))  # the table is last


@pytest.mark.integration
@pytest.mark.preset
def test_the_libraries_output_is_kept_in_one_log_file_per_actor(short_run):
    run_dir = short_run.run_dir
    assert short_run.returncode == 0, short_run.console[-4000:]
    logs = run_dir / "logs"
    assert sorted(p.stem for p in logs.glob("*.log")) == sorted([*ACTORS, "driver"])
    text = {role: (logs / f"{role}.log").read_text() for role in [*ACTORS, "driver"]}
    for role in [*ACTORS, "driver"]:
        assert re.match(rf"==== {role}: pid \d+, ", text[role]), role
    for role in ("generator-0", "generator-1"):
        assert "Initializing a V1 LLM engine" in text[role]  # vLLM's engine process started
        assert re.search(r"^\(EngineCore pid=\d+\) ", text[role], re.MULTILINE)
        assert "Model Runner V2 requires Triton" in text[role]
    for role in ("learner-0", "learner-1"):
        assert "Setting accelerator to CPU" in text[role]  # DeepSpeed's
    assert "Started a local Ray instance" in text["driver"]
    steps = short_run_module.STEPS
    assert f"INFO cagrpo_ray: step {steps}/{steps}" in text["driver"]
