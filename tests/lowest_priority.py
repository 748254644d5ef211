"""Run a command at the lowest CPU priority there is, in the session of its own it was started in.

    setsid -w python tests/lowest_priority.py COMMAND [ARG...]
    subprocess.Popen([sys.executable, "tests/lowest_priority.py", *command],
                     start_new_session=True)

`nice -n 19` alone is not enough on Linux with autogroup scheduling
(`kernel.sched_autogroup_enabled`, on by default): the CPU is shared fairly between sessions
first (one autogroup each), and a process's nice value ranks it only among the processes of its
own session. The integration tests start runs in sessions of their own (`python -m
cagrpo_ray.run` runs its driver in a new session, `tests/test_run_exits.py` each command), so a
nice-19 process in the test session took half of both cores from such a run, not what the run
left idle. This sets the autogroup nice of the command's own session to 19 as well
(`/proc/self/autogroup`; lowering a priority needs no privilege), then its own nice, then runs
it.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    if os.getsid(0) != os.getpid():
        raise SystemExit(
            "lowest_priority.py must lead a session of its own (setsid -w, or Popen's "
            "start_new_session=True): its autogroup's priority would be the starting session's"
        )
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("19")
    except OSError:  # a kernel without autogroup scheduling: the nice value alone applies
        pass
    os.nice(19 - os.nice(0))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
