"""Where the actors go: Ray placement groups reserve every actor's GPUs and CPUs before any
actor starts.

- A generator replica needs `tensor_parallel_size` GPUs in one process (vLLM's workers are
  its local processes) and so on one node: it gets one bundle of all of them
  (`STRICT_PACK`; a single bundle never spans nodes), and its actor holds that bundle.
- The learner ranks get one bundle each in one placement group packed onto as few nodes as
  possible (`PACK`), bundle i for rank i, so that neighbouring ranks share a node.
- No GPU is shared between roles: generator and learner actors ask for whole GPUs of their
  own (a colocated layout would need CUDA-IPC weight transfer; the sync group refuses two
  ranks on one GPU, see `sync/group.py`).
- Which nodes: `rollout.node_labels`, `learner.node_labels` and `reward.node_labels` name the
  Ray node labels each role's nodes must carry (a bundle label selector; on KubeRay the worker
  group is the label `ray.io/node-group`). Empty, any node will do.

Before anything is reserved, the request is checked against the nodes Ray reports, and a
layout the cluster cannot hold is refused naming what does not fit. On the CPU the same code
reserves CPU-only bundles; Ray's fake GPUs (`ray.init(num_gpus=...)`,
`ray.cluster_utils.Cluster`) let the GPU layouts be placed for real in tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cagrpo_ray.errors import UserError

log = logging.getLogger("cagrpo_ray")


class PlacementError(UserError, ValueError):
    """The cluster cannot hold the run's actors; the message says what does not fit."""


@dataclass(frozen=True)
class Bundle:
    """One actor's reservation: `role` names it in messages ("generator 3", "learner 0");
    `labels` ((key, value) pairs) are the Ray node labels its node must carry."""

    role: str
    cpus: float
    gpus: float
    labels: tuple[tuple[str, str], ...] = ()

    def resources(self) -> dict[str, float]:
        out = {"CPU": self.cpus}
        if self.gpus:
            out["GPU"] = self.gpus
        return out

    def label_selector(self) -> dict[str, str]:
        return dict(self.labels)

    def admits(self, node: dict) -> bool:
        """Whether `node` (an `alive_nodes` entry) carries this bundle's labels."""
        have = node.get("labels", {})
        return all(have.get(key) == value for key, value in self.labels)


def _labels(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def generator_bundle(config, replica: int) -> Bundle:
    r = config.rollout
    gpus = r.num_gpus_per_generator * r.tensor_parallel_size
    return Bundle(f"generator {replica}", r.num_cpus_per_generator, gpus, _labels(r.node_labels))


def learner_bundle(config, rank: int) -> Bundle:
    lcfg = config.learner
    return Bundle(
        f"learner {rank}",
        lcfg.num_cpus_per_learner,
        lcfg.num_gpus_per_learner,
        _labels(lcfg.node_labels),
    )


def reward_bundle(config) -> Bundle:
    """The reward pool's actor (not in a placement group: it holds no GPU)."""
    r = config.reward
    return Bundle("the reward pool", r.num_cpus, 0.0, _labels(r.node_labels))


def alive_nodes() -> list[dict]:
    """Each alive node's total CPUs and GPUs, its labels and its address, as Ray reports them."""
    return [
        {
            "CPU": node["Resources"].get("CPU", 0.0),
            "GPU": node["Resources"].get("GPU", 0.0),
            "labels": dict(node.get("Labels") or {}),
            "address": node.get("NodeManagerAddress", "?"),
        }
        for node in ray.nodes()
        if node.get("Alive")
    ]


def check_labels(bundles: list[Bundle], nodes: list[dict]) -> None:
    """Raise `PlacementError` naming the first bundle whose labels no alive node carries."""
    for bundle in bundles:
        if bundle.labels and not any(bundle.admits(n) for n in nodes):
            seen = sorted({f"{k}={v}" for n in nodes for k, v in n.get("labels", {}).items()})
            raise PlacementError(
                f"{bundle.role} needs a node labelled "
                f"{', '.join(f'{k}={v}' for k, v in bundle.labels)}, but no alive node is "
                f"(their labels: {', '.join(seen) or 'none'})"
            )


def check_fits(bundles: list[Bundle], nodes: list[dict]) -> None:
    """Raise `PlacementError` unless every bundle fits some node that carries its labels,
    each whole on one node.

    First fit, largest GPU bundles first (as Ray itself would need them placed): labels that no
    node carries are named, so is a GPU count that no node has, and so is the first bundle left
    over.
    """
    check_labels(bundles, nodes)
    free = [dict(node) for node in nodes]
    most = max((node.get("GPU", 0.0) for node in nodes), default=0.0)
    for bundle in sorted(bundles, key=lambda b: (-b.gpus, -b.cpus)):
        if bundle.gpus > most:
            raise PlacementError(
                f"{bundle.role} needs {bundle.gpus:g} GPUs on one node (its tensor-parallel "
                f"group), but the largest node has {most:g}"
            )
        home = next(
            (
                n
                for n in free
                if n["CPU"] >= bundle.cpus and n.get("GPU", 0.0) >= bundle.gpus and bundle.admits(n)
            ),
            None,
        )
        if home is None:
            need_gpus = sum(b.gpus for b in bundles)
            have_gpus = sum(n.get("GPU", 0.0) for n in nodes)
            raise PlacementError(
                f"the cluster cannot hold {bundle.role} ({bundle.cpus:g} CPUs, "
                f"{bundle.gpus:g} GPUs): the run needs {need_gpus:g} GPUs and "
                f"{sum(b.cpus for b in bundles):g} CPUs in all; the cluster has "
                f"{have_gpus:g} GPUs and {sum(n['CPU'] for n in nodes):g} CPUs on "
                f"{len(nodes)} nodes"
            )
        home["CPU"] -= bundle.cpus
        home["GPU"] = home.get("GPU", 0.0) - bundle.gpus


def selectors(bundles: list[Bundle]) -> list[dict[str, str]] | None:
    """Ray's `bundle_label_selector` for `bundles` (None where none has labels)."""
    if not any(b.labels for b in bundles):
        return None
    return [b.label_selector() for b in bundles]


def node_addresses(actors: dict[str, object], timeout_s: float = 60.0) -> dict[str, str]:
    """role -> the address of the node its actor runs on, asked of each actor itself (as Ray
    sees it: the node's IP, which on a machine of several loopback nodes tells them apart)."""
    if not actors:
        return {}
    refs = [a.__ray_call__.remote(_node_address) for a in actors.values()]
    return dict(zip(actors, ray.get(refs, timeout=timeout_s), strict=True))


def _node_address(_actor) -> str:
    return ray.util.get_node_ip_address()


def describe_nodes(where: dict[str, str]) -> str:
    """'127.0.0.3: generator 0, generator 1; 127.0.0.2: learner 0, reward pool' (by node)."""
    nodes: dict[str, list[str]] = {}
    for role, address in where.items():
        nodes.setdefault(address, []).append(role)
    return "; ".join(f"{address}: {', '.join(roles)}" for address, roles in nodes.items())


class Placement:
    """The run's placement groups; `generator(replica)` and `learner(rank)` are the Ray actor
    options that put each actor in its bundle. `remove()` releases them. With `generators`
    False only the learners are placed (the run was given replicas already up in groups of
    their own: `rollout/kept.py`)."""

    def __init__(self, config, timeout_s: float = 600.0, generators: bool = True):
        replicas = config.rollout.num_generators if generators else 0
        self.generator_bundles = [generator_bundle(config, i) for i in range(replicas)]
        self.learner_bundles = [
            learner_bundle(config, i) for i in range(config.learner.num_learners)
        ]
        nodes = alive_nodes()
        check_fits(self.generator_bundles + self.learner_bundles, nodes)
        check_labels([reward_bundle(config)], nodes)
        # The learners first, so that they are packed before the replicas spread out.
        self._learner_group = placement_group(
            [b.resources() for b in self.learner_bundles],
            strategy="PACK",
            name="cagrpo-learners",
            bundle_label_selector=selectors(self.learner_bundles),
        )
        _, pending = ray.wait([self._learner_group.ready()], timeout=timeout_s)
        if pending:
            remove_placement_group(self._learner_group)
            raise PlacementError(
                f"Ray could not place the learners within {timeout_s:g} s (another job holding "
                "the GPUs, or nodes still starting?)"
            )
        self._generator_groups = [
            placement_group(
                [b.resources()],
                strategy="STRICT_PACK",
                name=f"cagrpo-{b.role}",
                bundle_label_selector=selectors([b]),
            )
            for b in self.generator_bundles
        ]
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        groups = [*self._generator_groups, self._learner_group]
        names = [b.role for b in self.generator_bundles] + ["the learners"]
        refs = {group.ready(): name for group, name in zip(groups, names, strict=True)}
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if pending:
            self.remove()
            raise PlacementError(
                f"Ray could not place {', '.join(refs[ref] for ref in pending)} within "
                f"{timeout_s:g} s (another job holding the GPUs, or nodes still starting?)"
            )

    def generator(self, replica: int) -> dict:
        bundle = self.generator_bundles[replica]
        return dict(
            num_cpus=bundle.cpus,
            num_gpus=bundle.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._generator_groups[replica], placement_group_bundle_index=0
            ),
        )

    def learner(self, rank: int) -> dict:
        bundle = self.learner_bundles[rank]
        return dict(
            num_cpus=bundle.cpus,
            num_gpus=bundle.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._learner_group, placement_group_bundle_index=rank
            ),
        )

    def hand_over_generators(self) -> list:
        """The generators' placement groups, which `remove()` then leaves in place."""
        groups, self._generator_groups = self._generator_groups, []
        return groups

    def remove(self) -> None:
        for group in [*self._generator_groups, self._learner_group]:
            try:
                remove_placement_group(group)
            except Exception:  # already gone with its cluster
                log.debug("placement group already removed", exc_info=True)
        self._generator_groups = []
