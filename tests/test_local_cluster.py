"""The parts of `cagrpo_ray/local_cluster.py` that need no Ray: the nodes' addresses, what a
client is told, and `down`'s ending of exactly the cluster's processes. (The cluster itself is
started by tests/two_nodes.py for tests/test_multinode.py and tests/test_golden_schedule.py.)"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from cagrpo_ray.local_cluster import LocalCluster, NodeSpec, kill_processes, node_ip

pytestmark = pytest.mark.unit


def test_each_node_has_its_own_loopback_address_the_head_first():
    assert [node_ip(i) for i in range(3)] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    with pytest.raises(ValueError, match="at least one node"):
        LocalCluster([])


def test_a_client_gets_this_clusters_address_and_token_and_no_other():
    cluster = LocalCluster([NodeSpec("head")], "/tmp/cgn-unit")
    cluster.gcs_port = 6390
    inherited = {"PATH": "/bin", "RAY_ADDRESS": "10.0.0.1:6379", "RAY_AUTH_TOKEN": "other"}
    env = cluster.client_env(inherited)
    assert env["RAY_ADDRESS"] == "127.0.0.2:6390" and env["PATH"] == "/bin"
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN_PATH"] == "/tmp/cgn-unit/auth_token"
    assert "RAY_AUTH_TOKEN" not in env  # the other cluster's token is not sent here
    bare = cluster.client_env(inherited, token=False)
    assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(bare)


def test_down_ends_the_processes_that_name_the_directory_and_theirs_only(tmp_path):
    root = tmp_path / "cluster"
    # a "raylet" naming the directory, with a worker under it that does not
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
        "'import time; time.sleep(600)']); time.sleep(600)"  # fmt: skip
    ours = subprocess.Popen([sys.executable, "-c", sleeper, f"--temp-dir={root}/node0"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "elsewhere"])
    try:
        parent, deadline = psutil.Process(ours.pid), time.monotonic() + 30
        while not parent.children():
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        (child,) = parent.children()
        killed = kill_processes(root)
        assert set(killed) == {ours.pid, child.pid}
        for process in (parent, child):  # gone (kill_processes waited for them)
            assert not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None  # a process that does not name it is left alone
    finally:
        for process in (ours, other):
            process.kill()
            process.wait()
