"""Ending processes in order: SIGTERM, a grace period, then SIGKILL for what is still alive."""

from __future__ import annotations

from collections.abc import Sequence

import psutil  # a dependency of Ray and vLLM


def terminate_then_kill(processes: Sequence[psutil.Process], grace_s: float) -> None:
    """Send SIGTERM to each of `processes`, wait up to `grace_s` for them to end, SIGKILL the
    ones still alive and wait for those up to `grace_s` again. Processes that are already gone
    are skipped."""
    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    kill(alive, grace_s)


def kill(processes: Sequence[psutil.Process], wait_s: float) -> None:
    """SIGKILL each of `processes` (those already gone are skipped) and wait up to `wait_s`
    for them to end."""
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(processes, timeout=wait_s)
