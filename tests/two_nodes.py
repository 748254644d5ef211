"""The tests' Ray cluster of two nodes on this machine, and the one run on it that
tests/test_golden_schedule.py and tests/test_multinode.py both check (conftest.py's
`two_node_cluster` and `golden_run_on_two_nodes`, once a session).

The nodes (`cagrpo_ray/local_cluster.py`, token authentication on): 127.0.0.2, the head, in
group "learners", and 127.0.0.3 in group "generators". The run is the user's command joined
through RAY_ADDRESS with the cluster's token, on the golden schedule's config
(`tests/golden/record.py`: 10 steps of the embedded default with staleness bound 0), with the
learner ranks and the reward pool placed on the learners' node and both generator replicas on
the other, by the config's node labels (KubeRay's worker groups are `ray.io/node-group` too).
While it trains, the sockets listening on its stores' ports are noted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from cagrpo_ray.local_cluster import LocalCluster, NodeSpec, node_ip

HERE = Path(__file__).parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "golden"))
from record import overrides  # noqa: E402

GROUP = "ray.io/node-group"
LEARNERS, GENERATORS = node_ip(0), node_ip(1)
NODES = [NodeSpec("learners", 2), NodeSpec("generators", 2)]
PLACED = [
    f'rollout.node_labels={{"{GROUP}": "generators"}}',
    f'learner.node_labels={{"{GROUP}": "learners"}}',
    f'reward.node_labels={{"{GROUP}": "learners"}}',
]
NAME = "bound0"  # tests/golden/record.py's run


def cluster(root: str) -> LocalCluster:
    return LocalCluster(NODES, root)


def command(out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "cagrpo_ray.run", "--config", "configs/cpu-tiny.yaml"]
    for item in [*overrides(out, NAME), *PLACED]:
        cmd += ["--set", item]
    return cmd


def listening(port: int) -> list[str]:
    """The addresses with a TCP socket listening on `port` on this machine."""
    return sorted(
        c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    )


def logged_address(path: Path, marker: str) -> tuple[str, int]:
    """The host:port after `marker` on the first line of `path` that holds it."""
    for line in path.read_text(errors="replace").splitlines():
        if marker in line:
            host, _, port = line.split(marker, 1)[1].split()[0].rpartition(":")
            return host, int(port)
    raise AssertionError(f"no {marker!r} in {path}")


def run_on(nodes: LocalCluster, out: Path) -> dict:
    """The run on `nodes`; what listened on its stores' ports once it had trained a step."""
    run_dir = out / NAME
    console = out / "console.log"
    with console.open("w") as log:
        process = subprocess.Popen(
            command(out), cwd=REPO, env=nodes.client_env(), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 600
            while not (metrics.exists() and metrics.read_text().strip()):
                assert process.poll() is None, console.read_text()[-4000:]
                assert time.monotonic() < deadline, "no step within 10 minutes"
                time.sleep(0.5)
            stores = {
                "weight sync": logged_address(console, "the learner's store at "),
                "process group": logged_address(run_dir / "logs" / "learner-0.log", "store at "),
            }
            heard = {what: listening(port) for what, (_, port) in stores.items()}
            status = process.wait(timeout=600)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    summary = run_dir / "summary.json"
    return dict(
        status=status,
        console=console.read_text(),
        run_dir=run_dir,
        stores=stores,
        heard=heard,
        summary=json.loads(summary.read_text()) if summary.exists() else {},
    )
