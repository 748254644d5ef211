"""A run across the nodes of a Ray cluster: tests/two_nodes.py's two raylets on this machine
(127.0.0.2 and 127.0.0.3, token authentication on), the learner ranks and the reward pool on
the head's node (group "learners"), both generator replicas on the other ("generators"),
placed by the config's node labels as on KubeRay's worker groups, joined by the user's
command through RAY_ADDRESS with the cluster's token.

Each role ran where its labels say, and the run said so at its start; each node's actors wrote
their logs where the driver reads them; while it trained, the stores of the weight sync and of
the learners' process group listened on the learner node's address only (not every interface,
not loopback). Without the token the command is refused, in one line that says what to set.
That the same run trains, bit for bit, what a run on one node trains is
tests/test_golden_schedule.py's check of the same run.
"""

from __future__ import annotations

import subprocess

import pytest
from two_nodes import GENERATORS, LEARNERS, NAME, REPO, command

pytestmark = [pytest.mark.integration, pytest.mark.preset]


@pytest.fixture(scope="module")
def run(golden_run_on_two_nodes):
    run = golden_run_on_two_nodes
    assert run["status"] == 0, run["console"][-4000:]
    return run


def test_each_role_ran_on_the_nodes_its_labels_name(run):
    nodes = run["summary"]["nodes"]
    assert {nodes["generator 0"], nodes["generator 1"]} == {GENERATORS}, nodes
    learners = {nodes["learner 0"], nodes["learner 1"], nodes["the reward pool"]}
    assert learners == {LEARNERS}, nodes
    said = f"actors by node: {GENERATORS}: generator 0, generator 1; {LEARNERS}: learner 0"
    assert said in run["console"]
    for name in ("generator-0", "generator-1", "learner-0", "learner-1", "reward"):
        assert (run["run_dir"] / "logs" / f"{name}.log").stat().st_size > 0, name


def test_the_stores_listen_on_the_learner_node_only(run):
    for what, (host, _) in run["stores"].items():
        assert host == LEARNERS, (what, host)
        assert run["heard"][what] == [LEARNERS], (what, run["heard"][what])


def test_a_client_without_the_token_is_refused(two_node_cluster, tmp_path):
    done = subprocess.run(
        command(tmp_path),
        cwd=REPO,
        env=two_node_cluster.client_env(token=False),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]  # a user's error: one line, no traceback
    assert f"cannot join the Ray cluster at RAY_ADDRESS={two_node_cluster.address}" in output
    assert "needs RAY_AUTH_MODE=token and its token" in output
    assert "Traceback" not in output
    assert not (tmp_path / NAME / "metrics.jsonl").exists()
