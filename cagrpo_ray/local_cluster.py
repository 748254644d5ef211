"""A Ray cluster of several nodes on this one machine, for tests and for anyone trying a run
across nodes without hosts.

Each node is a raylet of its own with an address of its own in the loopback range (the whole of
127.0.0.0/8 answers locally): the head on 127.0.0.2, the others on 127.0.0.3, 127.0.0.4, ...,
joined with `ray start --address` as nodes on separate hosts join, with Ray's token
authentication on as a real cluster has it (every client must then hold the token). Each node
belongs to a group, which Ray turns into the node label `ray.io/node-group` (from
`RAY_NODE_TYPE_NAME`, as KubeRay sets it for each worker group), so a config places roles the
same way here and on KubeRay:

    python -m cagrpo_ray.local_cluster up --groups learners,generators
    source /tmp/cagrpo-cluster/env      # RAY_ADDRESS, RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH
    python -m cagrpo_ray.run --config configs/cpu-tiny.yaml \\
        --set 'rollout.node_labels={"ray.io/node-group": "generators"}' \\
        --set 'learner.node_labels={"ray.io/node-group": "learners"}'
    python -m cagrpo_ray.local_cluster down

The first group is the head's. Everything of the cluster lives under its directory (each
node's Ray temp dir, the token, the `env` file), and `down` ends every process that names that
directory and every process under them (Ray's workers, the engines they started), and only
those: `ray stop` would end every Ray cluster on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from cagrpo_ray.processes import kill

DEFAULT_DIR = "/tmp/cagrpo-cluster"  # short: Ray's socket paths must fit 107 bytes
HEAD_IP = "127.0.0.2"
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class NodeSpec:
    group: str  # the node's `ray.io/node-group` label
    cpus: float = 2.0


def node_ip(index: int) -> str:
    """Node `index`'s address: the head (0) on 127.0.0.2, then 127.0.0.3, ..."""
    return f"127.0.0.{2 + index}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_executable() -> str:
    """The `ray` of this interpreter's environment."""
    return str(Path(sys.executable).parent / "ray")


class LocalCluster:
    """The nodes of `nodes` under directory `root`; `start()` then `stop()` (or `with`)."""

    def __init__(self, nodes: list[NodeSpec], root: str | Path = DEFAULT_DIR):
        if not nodes:
            raise ValueError("a cluster needs at least one node (the head)")
        self.nodes = list(nodes)
        self.root = Path(root)
        self.token_path = self.root / "auth_token"
        self.gcs_port = 0
        self.dashboard_port = 0

    # ------------------------------------------------------------------ addresses

    @property
    def address(self) -> str:
        """The GCS address drivers join (`RAY_ADDRESS`)."""
        return f"{HEAD_IP}:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """Where `ray job submit --address` goes."""
        return f"http://{HEAD_IP}:{self.dashboard_port}"

    def client_env(self, base: dict | None = None, token: bool = True) -> dict:
        """`base` (os.environ) with this cluster's address and, with `token`, its token; no
        other Ray address or token is inherited."""
        env = {
            k: v
            for k, v in (os.environ if base is None else base).items()
            if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
        }
        env["RAY_ADDRESS"] = self.address
        if token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path))
        return env

    # ------------------------------------------------------------------ start and stop

    def start(self) -> LocalCluster:
        """Start the head, then the other nodes at once; return when every node is alive."""
        if self.root.exists() and processes_of(self.root):
            raise RuntimeError(
                f"a cluster is already running under {self.root}: "
                f"python -m cagrpo_ray.local_cluster down --dir {self.root}"
            )
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.gcs_port, self.dashboard_port = free_port(HEAD_IP), free_port(HEAD_IP)
        try:
            self._start_node(0)
            with ThreadPoolExecutor(max(1, len(self.nodes) - 1)) as pool:
                list(pool.map(self._start_node, range(1, len(self.nodes))))
            self._wait_alive()
        except BaseException:
            self.stop()
            raise
        (self.root / "env").write_text(
            "".join(
                f"export {k}={self.client_env({})[k]}\n"
                for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")
            )
            + f"# ray job submit --address {self.dashboard_url}\n"
        )
        return self

    def _start_node(self, index: int) -> None:
        spec, ip = self.nodes[index], node_ip(index)
        cmd = [
            ray_executable(), "start",
            f"--node-ip-address={ip}",
            f"--temp-dir={self.root / f'node{index}'}",
            f"--num-cpus={spec.cpus:g}",
            "--num-gpus=0",
            f"--node-manager-port={free_port(ip)}",
            f"--object-manager-port={free_port(ip)}",
            f"--metrics-export-port={free_port(ip)}",
            f"--dashboard-agent-listen-port={free_port(ip)}",
            f"--dashboard-agent-grpc-port={free_port(ip)}",
            f"--runtime-env-agent-port={free_port(ip)}",
            "--disable-usage-stats",
        ]  # fmt: skip
        if index == 0:
            cmd += [
                "--head",
                f"--port={self.gcs_port}",
                f"--dashboard-host={HEAD_IP}",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={free_port(HEAD_IP)}",
            ]
        else:
            cmd.append(f"--address={self.address}")
        env = self.client_env()
        env.pop("RAY_ADDRESS")
        # what KubeRay's pods have: the group as a label, processes ended with their group
        env.update(RAY_NODE_TYPE_NAME=spec.group, RAY_process_group_cleanup_enabled="1")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(
                f"node {index} ({ip}, {spec.group}) did not start:\n{done.stdout[-2000:]}"
                f"{done.stderr[-3000:]}"
            )

    def node_table(self) -> list[dict]:
        """[{"address", "group", "alive"}] of every node the head knows (asked in a fresh
        process, so that this one never joins the cluster)."""
        probe = (
            "import json, ray\n"
            "ray.init(logging_level='ERROR')\n"
            "print(json.dumps([dict(address=n['NodeManagerAddress'], alive=n['Alive'],\n"
            "    group=(n.get('Labels') or {}).get('ray.io/node-group')) for n in ray.nodes()]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", probe],
            env=self.client_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"cannot read the cluster's nodes: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def _wait_alive(self, timeout_s: float = START_TIMEOUT_S) -> None:
        want = {node_ip(i) for i in range(len(self.nodes))}
        deadline = time.monotonic() + timeout_s
        while True:
            alive = {n["address"] for n in self.node_table() if n["alive"]}
            if want <= alive:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes {sorted(want - alive)} not alive after {timeout_s:g} s")
            time.sleep(1.0)

    def kill_node(self, index: int) -> list[int]:
        """SIGKILL node `index`'s raylet and every process of it (a lost host); the pids."""
        return kill_processes(self.root / f"node{index}")

    def stop(self) -> None:
        """End every process of the cluster; its directory is removed."""
        kill_processes(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def processes_of(root: Path) -> list[psutil.Process]:
    """The processes that name `root` on their command line (GCS, raylets, agents, workers)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if process.pid != os.getpid() and any(
            str(root) in arg for arg in process.info["cmdline"] or []
        ):
            found.append(process)
    return found


def kill_processes(root: Path, timeout_s: float = 60.0) -> list[int]:
    """SIGKILL the processes of `root` (`processes_of`) and every process under them; wait
    until they are gone. Returns their pids."""
    tree: dict[int, psutil.Process] = {}
    for process in processes_of(root):
        try:
            tree.update({p.pid: p for p in [process, *process.children(recursive=True)]})
        except psutil.NoSuchProcess:
            continue
    kill(list(tree.values()), timeout_s)
    return sorted(tree)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cagrpo_ray.local_cluster",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("action", choices=("up", "down", "status"))
    parser.add_argument(
        "--dir", default=DEFAULT_DIR, help=f"the cluster's directory ({DEFAULT_DIR})"
    )
    parser.add_argument(
        "--groups",
        default="head,workers",
        help="one node per name, the head's first (each becomes the node's "
        "ray.io/node-group label); default: head,workers",
    )
    parser.add_argument("--cpus", type=float, default=2.0, help="Ray CPUs per node (2)")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    if args.action == "down":
        pids = kill_processes(root)
        shutil.rmtree(root, ignore_errors=True)
        print(f"ended {len(pids)} processes of the cluster under {root}")
        return 0
    if args.action == "status":
        running = processes_of(root)
        print(f"{len(running)} processes of a cluster under {root}")
        return 0 if running else 1
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    cluster = LocalCluster([NodeSpec(g, args.cpus) for g in groups], root).start()
    for index, group in enumerate(groups):
        print(f"node {index}: {node_ip(index)}  ray.io/node-group={group}  CPUs {args.cpus:g}")
    print(f"dashboard and jobs: {cluster.dashboard_url}")
    print(f"clients: source {root / 'env'}   (RAY_ADDRESS={cluster.address}, token auth)")
    print(f"stop: python -m cagrpo_ray.local_cluster down --dir {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
