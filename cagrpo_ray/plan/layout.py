"""Which actor goes on which node and GPU, as the planner lays them out.

Every GPU hosts one role (the config refuses fractions of GPUs): a generator replica takes
`rollout.tensor_parallel_size` GPUs of one node (a TP group never spans nodes), then learner
ranks fill the GPUs left, node by node in order, so that they share as few nodes as possible.
Generator replicas are placed first because their groups are the harder fit. This is the
layout Ray's placement groups give the run (`cagrpo_ray/placement.py`: one STRICT_PACK bundle
per replica, the learners' bundles PACKed); Ray picks the GPU indices, so a real run may
number them differently, but no GPU holds more than its role.
"""

from __future__ import annotations

from dataclasses import dataclass

from cagrpo_ray.config import Config
from cagrpo_ray.errors import UserError


class PlanError(UserError, ValueError):
    """The run does not fit the cluster; the message names the actor, the GPU or the
    component, and what would fit."""


@dataclass(frozen=True)
class ClusterShape:
    """GPU nodes of a cluster. `node_gpus` gives each node's GPU count when they differ (a Ray
    cluster); otherwise every one of `nodes` has `gpus_per_node`."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 80.0
    node_gpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.node_gpus and len(self.node_gpus) != self.nodes:
            raise ValueError(f"node_gpus has {len(self.node_gpus)} entries for {self.nodes} nodes")

    def gpus_on(self, node: int) -> int:
        return self.node_gpus[node] if self.node_gpus else self.gpus_per_node

    @property
    def total_gpus(self) -> int:
        return sum(self.gpus_on(node) for node in range(self.nodes))

    def describe(self) -> str:
        counts = (
            "+".join(map(str, self.node_gpus))
            if self.node_gpus
            else f"{self.nodes} x {self.gpus_per_node}"
        )
        return f"{self.nodes} node(s), {counts} GPUs of {self.gpu_memory_gib:g} GiB"

    @classmethod
    def from_config(cls, config: Config) -> ClusterShape:
        """The `cluster` section; raises PlanError when `cluster.nodes` is not set."""
        c = config.cluster
        if c.nodes is None:
            raise PlanError(
                "cluster.nodes is not set: give the cluster's shape (--nodes N, or cluster.nodes "
                "in the config), or plan against the Ray cluster (ClusterShape.from_ray)"
            )
        return cls(c.nodes, c.gpus_per_node, c.gpu_memory_gib)

    @classmethod
    def from_ray(cls, gpu_memory_gib: float = 80.0, nodes: list[dict] | None = None):
        """The GPU nodes of the running Ray cluster (`ray.nodes()`, or `nodes` as it returns
        them): alive nodes with at least one GPU. Ray does not know GPU memory, so it is given
        (the config's `cluster.gpu_memory_gib`)."""
        if nodes is None:
            import ray

            nodes = ray.nodes()
        counts = [
            int(node.get("Resources", {}).get("GPU", 0))
            for node in nodes
            if node.get("Alive", True) and node.get("Resources", {}).get("GPU", 0) >= 1
        ]
        uniform = len(set(counts)) <= 1
        return cls(
            len(counts),
            counts[0] if counts else 0,
            gpu_memory_gib,
            () if uniform else tuple(counts),
        )


@dataclass(frozen=True)
class GpuSlot:
    """One GPU and the actor on it: role "generator" (replica `index`, TP rank `tp_rank` of
    `tp_size`) or "learner" (rank `index`)."""

    node: int
    gpu: int
    role: str
    index: int
    tp_rank: int = 0
    tp_size: int = 1

    def describe(self) -> str:
        if self.role == "generator":
            return f"generator {self.index} (TP rank {self.tp_rank}/{self.tp_size})"
        return f"learner rank {self.index}"


def gpu_roles(config: Config) -> tuple[int, int, list[str]]:
    """(GPUs per generator replica, GPUs per learner rank, problems with the GPU counts);
    0 means the role runs on CPUs."""
    r, lc = config.rollout, config.learner
    per_generator = r.tensor_parallel_size if r.num_gpus_per_generator else 0
    per_learner = 1 if lc.num_gpus_per_learner else 0
    problems = [
        f"{key} {value:g}: {who} uses one GPU, the others would idle; set it to 1"
        for key, value, who in (
            ("rollout.num_gpus_per_generator", r.num_gpus_per_generator, "a TP worker"),
            ("learner.num_gpus_per_learner", lc.num_gpus_per_learner, "a learner rank"),
        )
        if value > 1
    ]
    return per_generator, per_learner, problems


def place(config: Config, cluster: ClusterShape) -> tuple[list[GpuSlot], list[str]]:
    """Assign GPUs to the run's GPU actors. Returns the slots (ordered by node and GPU) and the
    problems, each naming an actor that found no place and what the cluster has left."""
    per_generator, per_learner, problems = gpu_roles(config)
    free = [list(range(cluster.gpus_on(node))) for node in range(cluster.nodes)]
    slots: list[GpuSlot] = []
    if per_generator:
        tp = per_generator
        for replica in range(config.rollout.num_generators):
            node = next((n for n in range(cluster.nodes) if len(free[n]) >= tp), None)
            if node is None:
                problems.append(_no_room_for_replica(replica, tp, free, cluster))
                break
            taken, free[node] = free[node][:tp], free[node][tp:]
            slots += [
                GpuSlot(node, gpu, "generator", replica, rank, tp) for rank, gpu in enumerate(taken)
            ]
    if per_learner:
        for rank in range(config.learner.num_learners):
            node = next((n for n in range(cluster.nodes) if free[n]), None)
            if node is None:
                used = sum(1 for slot in slots if slot.role == "generator")
                problems.append(
                    f"learner rank {rank} needs a GPU: all {cluster.total_gpus} GPUs of "
                    f"{cluster.describe()} are taken ({used} by generators, {rank} by "
                    f"learners); {config.learner.num_learners} learner ranks and "
                    f"{config.rollout.num_generators} generator replicas of "
                    f"{per_generator or 0} GPU(s) need {_gpus_needed(config)}"
                )
                break
            slots.append(GpuSlot(node, free[node].pop(0), "learner", rank))
    slots.sort(key=lambda slot: (slot.node, slot.gpu))
    return slots, problems


def _gpus_needed(config: Config) -> int:
    per_generator, per_learner, _ = gpu_roles(config)
    return config.rollout.num_generators * per_generator + config.learner.num_learners * per_learner


def _no_room_for_replica(replica: int, tp: int, free: list[list[int]], cluster: ClusterShape):
    where = f"rollout.tensor_parallel_size {tp}; a TP group never spans nodes"
    widest = max(range(cluster.nodes), key=lambda n: cluster.gpus_on(n), default=None)
    if widest is None or cluster.gpus_on(widest) < tp:
        most = 0 if widest is None else cluster.gpus_on(widest)
        return (
            f"generator replica {replica} needs {tp} GPUs on one node ({where}); nodes have {most}"
        )
    best = max(range(cluster.nodes), key=lambda n: len(free[n]))
    return (
        f"generator replica {replica} needs {tp} GPUs on one node ({where}); node {best} has "
        f"{len(free[best])} left, no node more"
    )
