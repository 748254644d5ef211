"""Before launch: does a recipe fit its cluster? Which actor goes on which GPU, and what each
GPU holds, by component.

    plan = plan(config, ClusterShape(nodes=1, gpus_per_node=8, gpu_memory_gib=80))
    print(render(plan)); plan.fits; plan.problems
    check(config, ClusterShape.from_ray(config.cluster.gpu_memory_gib))  # raises PlanError

The command line is `python -m cagrpo_ray.plan --config FILE [--nodes N] [--json]` (`cli.py`).
Layout rules are in `layout.py`, the estimates and their sources in `memory.py`, model
shapes in `shapes.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cagrpo_ray.config import Config
from cagrpo_ray.plan.layout import ClusterShape, GpuSlot, PlanError, gpu_roles, place
from cagrpo_ray.plan.memory import (
    Estimate,
    GiB,
    cpu_generator_memory,
    generator_memory,
    learner_memory,
)
from cagrpo_ray.plan.shapes import ModelShape, ModelShapeError, model_shape

__all__ = [
    "ClusterShape",
    "GpuPlan",
    "ModelShapeError",
    "Plan",
    "PlanError",
    "check",
    "plan",
    "render",
    "to_json",
]


@dataclass(frozen=True)
class GpuPlan:
    """One GPU: its actor, the estimate, the GPU's memory, and whether the estimate fits."""

    slot: GpuSlot
    estimate: Estimate
    capacity_bytes: int
    fits: bool


@dataclass
class Plan:
    """Placement and per-GPU estimates of a config on a cluster; `problems` say what does not
    fit (empty when `fits`)."""

    config: Config
    shape: ModelShape
    cluster: ClusterShape | None
    gpus: list[GpuPlan] = field(default_factory=list)
    cpu_actors: list[tuple[str, Estimate]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f}"


def _learner_problem(gpu: GpuPlan, others: int) -> str:
    e, largest = gpu.estimate, gpu.estimate.largest()
    more = f" and {others} more learner GPU(s)" if others else ""
    return (
        f"node {gpu.slot.node} GPU {gpu.slot.gpu} ({gpu.slot.describe()}){more}: needs "
        f"{_gib(e.total)} GiB of {_gib(gpu.capacity_bytes)} GiB; largest component: "
        f"{largest.name} {_gib(largest.bytes)} GiB ({largest.note})"
    )


def _generator_problem(gpu: GpuPlan, others: int, config: Config) -> str:
    e, r = gpu.estimate, config.rollout
    kv, detail = e.component("kv_cache"), e.detail
    more = f" and {others} more generator GPU(s)" if others else ""
    overhead = ", ".join(f"{c.name} {_gib(c.bytes)}" for c in e.components if c is not kv)
    return (
        f"node {gpu.slot.node} GPU {gpu.slot.gpu} ({gpu.slot.describe()}){more}: component "
        f"kv_cache gets {_gib(kv.bytes)} GiB of vLLM's {_gib(detail['vllm_share_bytes'])} GiB "
        f"(rollout.gpu_memory_utilization {r.gpu_memory_utilization:g}) after {overhead} GiB; "
        f"it must hold one rollout.max_model_len {r.max_model_len}-token sequence "
        f"({_gib(detail['kv_bytes_per_sequence'])} GiB)"
    )


def plan(config: Config, cluster: ClusterShape | None = None, online: bool = False) -> Plan:
    """Place the config's GPU actors on `cluster` (default: the config's `cluster` section)
    and estimate each GPU. CPU actors are listed with their estimates but not checked.

    Raises ModelShapeError when the model's shape is unknown, and PlanError when GPUs are asked
    for and no cluster shape is known; everything else that does not fit is in `problems`.
    """
    shape = model_shape(config.model.path, online=online, gguf_file=config.model.gguf_file)
    per_generator, per_learner, problems = gpu_roles(config)
    problems += tensor_parallel_problems(config, shape)
    if cluster is None and (per_generator or per_learner or config.cluster.nodes):
        cluster = ClusterShape.from_config(config)
    result = Plan(config, shape, cluster, problems=problems)
    if per_generator == 0:
        result.cpu_actors += [
            (f"generator {i}", cpu_generator_memory(config, shape))
            for i in range(config.rollout.num_generators)
        ]
    if per_learner == 0:
        cpu_learner = learner_memory(config, shape, device="cpu")
        result.cpu_actors += [
            (f"learner rank {i}", cpu_learner) for i in range(config.learner.num_learners)
        ]
    if not (per_generator or per_learner):
        return result
    slots, placement_problems = place(config, cluster)
    result.problems += placement_problems
    capacity = int(cluster.gpu_memory_gib * GiB)
    learner = learner_memory(config, shape) if per_learner else None
    generator = generator_memory(config, shape, capacity) if per_generator else None
    for slot in slots:
        if slot.role == "learner":
            fits = learner.total <= capacity
            result.gpus.append(GpuPlan(slot, learner, capacity, fits))
        else:
            kv = generator.component("kv_cache").bytes
            fits = kv >= generator.detail["kv_bytes_per_sequence"]
            result.gpus.append(GpuPlan(slot, generator, capacity, fits))
    for role in ("generator", "learner"):
        failed = [g for g in result.gpus if g.slot.role == role and not g.fits]
        if failed and role == "learner":
            result.problems.append(_learner_problem(failed[0], len(failed) - 1))
        elif failed:
            result.problems.append(_generator_problem(failed[0], len(failed) - 1, config))
    return result


def tensor_parallel_problems(config: Config, shape: ModelShape) -> list[str]:
    """vLLM shards attention heads over a replica's tensor-parallel workers: the query heads
    must split evenly, and the KV heads must split evenly or be replicated evenly."""
    tp = config.rollout.tensor_parallel_size
    heads, kv = shape.num_heads, shape.num_kv_heads
    if tp == 1 or (heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)):
        return []
    return [
        f"rollout.tensor_parallel_size {tp} does not divide the model's attention heads "
        f"({heads} query, {kv} key/value heads): choose a size that divides {heads} and "
        f"divides or is a multiple of {kv}"
    ]


def check(config: Config, cluster: ClusterShape | None = None, online: bool = False) -> Plan:
    """`plan`, raising PlanError with the first problem when the config does not fit. The run
    calls it before any actor starts."""
    result = plan(config, cluster, online=online)
    if not result.fits:
        raise PlanError(result.problems[0])
    return result


def _components_text(estimate: Estimate) -> str:
    def listed(phase: str) -> str:
        # components under 0.05 GiB are left out here (they stay in the JSON)
        return " ".join(
            f"{c.name} {_gib(c.bytes)}"
            for c in estimate.components
            if c.phase == phase and c.bytes >= 0.05 * GiB
        )

    text = listed("resident")
    backward, step = estimate.phase_total("backward"), estimate.phase_total("step")
    if backward or step:
        larger = "backward" if backward >= step else "step"
        for phase in ("backward", "step"):
            mark = "*" if phase == larger else ""
            text += f" | {phase}{mark}: {listed(phase)}"
    return text


def render(result: Plan) -> str:
    """A short table: one line per GPU (node, GPU, role, GiB, components), then the verdict.
    Learner GPUs show the resident components, then the backward and the step transients; the
    larger of the two (marked *) counts."""
    c, shape = result.config, result.shape
    lines = [
        f"model: {c.model.path} ({shape.parameters() / 1e9:.3g} B parameters, {c.model.dtype})",
        f"cluster: {result.cluster.describe() if result.cluster else 'none (CPU actors only)'}",
    ]
    if result.gpus:
        lines.append(f"{'node':>4} {'gpu':>3}  {'role':<28}{'GiB':>6}{'of':>6}  components (GiB)")
    for gpu in result.gpus:
        e, slot = gpu.estimate, gpu.slot
        total = e.detail.get("vllm_share_bytes", e.total)
        text = _components_text(e)
        if "kv_sequences" in e.detail:
            text += f" ({e.detail['kv_sequences']:.0f} sequences of {c.rollout.max_model_len})"
        lines.append(
            f"{slot.node:>4} {slot.gpu:>3}  {slot.describe():<28}{_gib(total):>6}"
            f"{_gib(gpu.capacity_bytes):>6}  {text}"
        )
    if result.cpu_actors:
        roles = ", ".join(role for role, _ in result.cpu_actors)
        lines.append(f"on CPUs (not checked): {roles}")
    if result.fits:
        lines.append("fits")
    else:
        lines += ["does not fit:"] + [f"  {problem}" for problem in result.problems]
    return "\n".join(lines)


def _estimate_json(estimate: Estimate) -> dict:
    return {
        "total_gib": round(estimate.detail.get("vllm_share_bytes", estimate.total) / GiB, 3),
        "components": [
            {"name": c.name, "gib": round(c.bytes / GiB, 3), "phase": c.phase, "note": c.note}
            for c in estimate.components
        ],
        "detail": estimate.detail,
    }


def to_json(result: Plan) -> dict:
    """The plan as one JSON-serialisable object: `fits`, `problems`, `cluster`, `model`, and
    `gpus`, one entry per GPU with its node, index, role and estimate in GiB."""
    cluster = result.cluster
    return {
        "fits": result.fits,
        "problems": result.problems,
        "cluster": None
        if cluster is None
        else {
            "nodes": cluster.nodes,
            "gpus_per_node": list(cluster.node_gpus) or cluster.gpus_per_node,
            "gpu_memory_gib": cluster.gpu_memory_gib,
        },
        "model": {
            "path": result.config.model.path,
            "dtype": result.config.model.dtype,
            "parameters": result.shape.parameters(),
            "shape_source": result.shape.source,
        },
        "gpus": [
            {
                "node": gpu.slot.node,
                "gpu": gpu.slot.gpu,
                "role": gpu.slot.describe(),
                "actor": gpu.slot.role,
                "index": gpu.slot.index,
                "tp_rank": gpu.slot.tp_rank,
                "tp_size": gpu.slot.tp_size,
                "capacity_gib": round(gpu.capacity_bytes / GiB, 3),
                "fits": gpu.fits,
                **_estimate_json(gpu.estimate),
            }
            for gpu in result.gpus
        ],
        "cpu_actors": [
            {"role": role, **_estimate_json(estimate)} for role, estimate in result.cpu_actors
        ],
    }
