"""Placement on a real Ray cluster with fake GPUs: every tensor-parallel group on one node with
devices of its own, learners packed per node, no GPU shared between roles, and layouts the
cluster cannot hold refused before anything starts.

Ray accepts GPUs that do not exist (`num_gpus` on a CPU machine) and sets CUDA_VISIBLE_DEVICES
for the actors that get them; `ray.cluster_utils.Cluster` runs several such nodes here, so the
7B recipe's two nodes of 8 GPUs are placed for real. Stand-in actors report where they landed.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from cagrpo_ray.config import load_config
from cagrpo_ray.placement import Bundle, Placement, PlacementError, check_fits

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

RECIPE_7B = "configs/gpu-7b-multinode.yaml"
RECIPE_15B = "configs/gpu-r1-distill-1.5b.yaml"
POOL = "cagrpo-test/pool"  # the worker nodes' label (KubeRay's would be ray.io/node-group)


@ray.remote
class StandIn:
    """Holds a placement like a generator or learner would, and says where it is."""

    def where(self) -> tuple[str, list[str]]:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return ray.get_runtime_context().get_node_id(), [d for d in devices.split(",") if d]


def place(config) -> tuple[list, list]:
    """(generator replicas, learner ranks) as [(node, devices)] under `config`'s placement."""
    placement = Placement(config, timeout_s=120)
    try:
        generators = [
            StandIn.options(**placement.generator(i)).remote()
            for i in range(config.rollout.num_generators)
        ]
        learners = [
            StandIn.options(**placement.learner(i)).remote()
            for i in range(config.learner.num_learners)
        ]
        where = ray.get([a.where.remote() for a in generators + learners])
        for actor in generators + learners:
            ray.kill(actor)
        n = len(generators)
        return where[:n], where[n:]
    finally:
        placement.remove()


def assert_exclusive(groups: list[tuple[str, list[str]]]) -> None:
    """No (node, device) pair held by two actors."""
    held = [(node, d) for node, devices in groups for d in devices]
    assert len(held) == len(set(held)), held


@pytest.fixture(scope="module")
def two_nodes():
    """A head without GPUs (as in k8s/) and two workers of 8 fake GPUs and 48 CPUs each,
    labelled POOL=a and POOL=b."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 0})
    workers = [
        cluster.add_node(num_cpus=48, num_gpus=8, labels={POOL: name}) for name in ("a", "b")
    ]
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield [w.node_id for w in workers]
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.integration
def test_the_7b_recipe_lands_on_two_nodes_of_eight_gpus(two_nodes):
    config = load_config(RECIPE_7B)
    generators, learners = place(config)
    assert all(len(devices) == 1 for _, devices in generators + learners)
    assert_exclusive(generators + learners)
    assert {node for node, _ in generators + learners} <= set(two_nodes)
    # learners packed: the 8 ranks fill one node
    assert len({node for node, _ in learners}) == 1


@pytest.mark.integration
def test_tensor_parallel_groups_stay_on_one_node_with_their_own_gpus(two_nodes):
    config = load_config(
        RECIPE_15B,
        ["rollout.num_generators=4", "rollout.tensor_parallel_size=2", "learner.num_learners=8"],
    )
    generators, learners = place(config)
    assert all(len(devices) == 2 for _, devices in generators)  # one bundle, both GPUs
    assert all(len(devices) == 1 for _, devices in learners)
    assert_exclusive(generators + learners)
    assert len({node for node, _ in learners}) == 1


@pytest.mark.integration
def test_layouts_the_cluster_cannot_hold_are_refused_before_anything_starts(two_nodes):
    too_wide = load_config(RECIPE_15B, ["rollout.tensor_parallel_size=16"])
    with pytest.raises(PlacementError, match="generator 0 needs 16 GPUs on one node"):
        Placement(too_wide, timeout_s=10)
    too_many = load_config(RECIPE_7B, ["rollout.num_generators=9"])
    with pytest.raises(PlacementError, match="needs 17 GPUs .* the cluster has 16 GPUs"):
        Placement(too_many, timeout_s=10)
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )  # nothing was reserved


@pytest.mark.integration
def test_node_labels_put_each_role_on_its_nodes(two_nodes):
    """The 7B recipe with its generators on the node labelled b and its learners on a: the
    opposite of where packing the learners first would put them, whichever node that is."""
    for generators_on, learners_on in (("b", "a"), ("a", "b")):
        config = load_config(
            RECIPE_7B,
            [
                f'rollout.node_labels={{"{POOL}": "{generators_on}"}}',
                f'learner.node_labels={{"{POOL}": "{learners_on}"}}',
            ],
        )
        generators, learners = place(config)
        node = dict(zip("ab", two_nodes, strict=True))
        assert {n for n, _ in generators} == {node[generators_on]}
        assert {n for n, _ in learners} == {node[learners_on]}
    nowhere = load_config(RECIPE_7B, [f'learner.node_labels={{"{POOL}": "c"}}'])
    with pytest.raises(PlacementError, match=f"learner 0 needs a node labelled {POOL}=c"):
        Placement(nowhere, timeout_s=10)


@pytest.mark.unit
def test_labels_confine_a_bundle_to_the_nodes_that_carry_them():
    a = {"CPU": 8, "GPU": 4, "labels": {"pool": "a"}}
    b = {"CPU": 8, "GPU": 4, "labels": {"pool": "b", "zone": "z"}}
    on_b = (("pool", "b"),)
    check_fits([Bundle("generator 0", 1, 4, on_b)], [a, b])
    # both fit the cluster, not the one node that carries their label
    with pytest.raises(PlacementError, match="generator 1 .* needs 8 GPUs"):
        check_fits([Bundle(f"generator {i}", 1, 4, on_b) for i in range(2)], [a, b])
    with pytest.raises(PlacementError, match="labelled pool=c, but no alive node is .*pool=a"):
        check_fits([Bundle("learner 0", 1, 1, (("pool", "c"),))], [a, b])
    # every label must match, not one of them
    assert not Bundle("x", 1, 0, (("pool", "b"), ("zone", "y"))).admits(b)
    assert Bundle("x", 1, 0, (("pool", "b"), ("zone", "z"))).admits(b)
    assert Bundle("x", 1, 0).admits(a)


@pytest.mark.unit
def test_first_fit_names_what_does_not_fit():
    nodes = [{"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4}]
    check_fits([Bundle("generator 0", 1, 4), Bundle("generator 1", 1, 4)], nodes)
    with pytest.raises(PlacementError, match="generator 2 .* needs 12 GPUs"):
        check_fits([Bundle(f"generator {i}", 1, 4) for i in range(3)], nodes)
    with pytest.raises(PlacementError, match="learner 0 needs 8 GPUs on one node"):
        check_fits([Bundle("learner 0", 1, 8)], nodes)
    check_fits([Bundle("generator 0", 0.5, 0), Bundle("learner 0", 0.5, 0)], [{"CPU": 2}])


@pytest.mark.integration
def test_kept_replicas_keep_their_groups_and_the_next_run_places_only_its_learners(two_nodes):
    from cagrpo_ray.rollout.kept import KeptGenerators

    config = load_config(RECIPE_7B)  # generators and learners fill both nodes' 16 GPUs
    n = config.rollout.num_generators
    first = Placement(config, timeout_s=120)
    kept = KeptGenerators()
    replicas = [StandIn.options(**first.generator(i)).remote() for i in range(n)]
    kept.hold(replicas, first.hand_over_generators(), "started alike")
    first.remove()  # the learners' group alone: the replicas stay, in theirs
    held = ray.get([a.where.remote() for a in replicas])
    assert kept.fits("started alike") and not kept.fits("started otherwise")

    second = Placement(config, timeout_s=120, generators=False)
    assert second.generator_bundles == []
    ranks = [
        StandIn.options(**second.learner(i)).remote() for i in range(len(second.learner_bundles))
    ]
    placed = ray.get([a.where.remote() for a in ranks])
    assert_exclusive(held + placed)  # the second run's ranks on the GPUs the first one freed
    assert len(held + placed) == 16
    for actor in ranks:
        ray.kill(actor)
    second.remove()
    kept.close()
    assert kept.actors == [] and not kept.fits("started alike")
    deadline = time.monotonic() + 30  # every GPU back once the replicas' groups are removed
    while ray.available_resources().get("GPU", 0) < 16:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)
