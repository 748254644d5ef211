"""The command line's outer process: the run's driver in a session of its own, signals passed
on to it, and nothing it started left behind.

`python -m cagrpo_ray.run` starts the driver (the same command, with `DRIVER_ENV` set) as a
child in a new session and waits for it. A signal sent to the whole process group — what
`timeout`, Slurm's `scancel` and a terminal's Ctrl-C send — then reaches only this process,
which passes it to the driver alone; the driver finishes its step, writes a checkpoint and
shuts down the local Ray cluster it started, in that order. Without the new session, the GCS
and raylet of that cluster (the driver's children, in its process group) died of the same
SIGTERM while the driver finished its step; it then waited 60 s for the dead GCS and exited 1,
and the generators' vLLM engine cores were left running, re-parented to init.

This process is the subreaper of everything under it (Linux `PR_SET_CHILD_SUBREAPER`): a
process the run started that outlives its parent is re-parented here, not to init. Once the
driver has exited, whatever is still under this process gets `settle_s` to end by itself,
then SIGTERM, then SIGKILL `grace_s` later, and a warning names it. Ray's per-node agents are
the exception: once the raylet that started them is gone (with a driver that was killed, the
local cluster's GCS and raylet end within a second), they neither end by themselves nor on
SIGTERM (measured: both still up 10 s after it, until SIGKILL), and they hold nothing of the
run, so they are killed as soon as nothing else is left: a killed driver's command exits in
about a second instead of `settle_s + grace_s`. The driver ends with this
process too: it gets SIGTERM (`PR_SET_PDEATHSIG`) should this one be killed outright.

Exit status: the driver's; 128 + N when signal N ended the driver itself (137: SIGKILL).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil  # a dependency of Ray and vLLM

from cagrpo_ray.processes import kill, terminate_then_kill

DRIVER_ENV = "CAGRPO_RAY_DRIVER"  # set in the driver: it runs the run instead of starting one
FORWARDED = (signal.SIGTERM, signal.SIGINT)
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # their process titles
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def supervise(argv: list[str], settle_s: float = 5.0, grace_s: float = 10.0) -> int:
    """Run `python -m cagrpo_ray.run *argv` as the driver, in a new session; return its exit
    status once nothing it started is left (see the module's docstring)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    parent = os.getpid()
    driver = subprocess.Popen(
        [sys.executable, "-m", "cagrpo_ray.run", *argv],
        env={**os.environ, DRIVER_ENV: "1"},
        start_new_session=True,
        preexec_fn=lambda: _stop_with(parent),
    )

    def pass_on(signum, _frame):
        driver.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in FORWARDED}
    try:
        status = driver.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    end_leftovers(settle_s, grace_s)
    return 128 - status if status < 0 else status


def end_leftovers(settle_s: float, grace_s: float) -> list[str]:
    """End every process still under this one: those that have not ended by themselves
    within `settle_s` get SIGTERM, then SIGKILL after `grace_s`. Returns what had to be
    signalled ("pid name"), also logged to stderr."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        live = _live_descendants()
        if not live or all(_is_ray_agent(process) for process in live):
            break
        time.sleep(0.2)
    left = _live_descendants()
    agents = [process for process in left if _is_ray_agent(process)]
    others = [process for process in left if process not in agents]
    named = []
    for process in others:
        try:
            named.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            continue
    if named:
        print(f"cagrpo_ray: ending what the run left running: {', '.join(named)}",
              file=sys.stderr, flush=True)  # fmt: skip
    terminate_then_kill(others, grace_s)
    kill(agents, grace_s)  # SIGTERM does not end them (module docstring)
    _reap()
    return named


def _is_ray_agent(process: psutil.Process) -> bool:
    try:
        title = " ".join(process.cmdline())
    except psutil.Error:
        return False
    return title.startswith(RAY_AGENTS)


def _live_descendants() -> list[psutil.Process]:
    _reap()  # an orphan that exited is a zombie of this process until it is waited for
    try:
        tree = psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    live = []
    for process in tree:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                live.append(process)
        except psutil.NoSuchProcess:
            continue
    return live


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _stop_with(parent: int) -> None:
    """In the driver, before it runs: SIGTERM when the supervisor dies, so that a supervisor
    killed outright still leaves the driver to stop in order."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the supervisor died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _prctl(option: int, value: int) -> None:
    """Linux `prctl(option, value)`; elsewhere nothing (the driver then runs as before,
    without a subreaper to end what it leaves)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")
