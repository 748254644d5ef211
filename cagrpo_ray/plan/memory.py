"""Memory of one GPU, by component: a DeepSpeed learner rank or a vLLM generator's TP rank.

Units are bytes; P is the parameter count, s the model dtype's bytes (4 float32, 2 bfloat16),
N the number of learner ranks (DeepSpeed's data-parallel world).

A learner rank's components belong to one of three phases of a training step. `resident`
ones live through the step; `backward` ones exist while a micro-batch's graph is alive;
`step` ones exist after the last backward (gradient reduction, the optimizer step). The peak is
resident + max(backward, step). Model states, per ZeRO stage (read in DeepSpeed 0.19.8's
stage_1_and_2.py, stage3.py and bf16_optimizer.py; measured on CPU for float32 stages 0 and 2
and bfloat16 stages 1 to 3, see tests/test_plan_memory.py):

    stage  weights  gradients                        optimizer (fp32 master + 2 moments)
    0      sP       4P (float32 models only)          8P (the float32 weights are the master)
    1      sP       bf16: 4P fp32 buffer + 2P bf16;   12P/N (fp32 models: 4P/N master clone
                    fp32: 4P/N                          + 8P/N)
    2      sP       4P/N fp32 partition               12P/N
    3      sP/N     4P/N fp32 partition               12P/N (fp32 models: 8P/N, no clone)

bfloat16 models accumulate gradients in float32 (learner/distributed.py), so DeepSpeed runs its
BF16_Optimizer at stage 1 (no reduce bucket) and fp32 gradient partitions at stages 2 and 3.

Under LoRA (`model.lora.rank` r > 0) the base keeps only its weights (sP, or sP/N at stage 3)
and the table's gradient and optimizer rows hold for the adapter's T parameters in float32
(DeepSpeed's bf16 mode is off: the trained parameters are float32 themselves), with
T = layers x r x sum(in + out) over the targeted linear layers (`lora_parameters`). The adapter's
weights add 4T on every rank (its tensors are under ZeRO-3's persistence threshold in the
recipes, so kept whole); the KL reference is the base with the adapter off (no copy); the head
is frozen (no head gradient). A vLLM generator with LoRA adds its adapter slots' buffers
(`lora_slot_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cagrpo_ray.config import Config
from cagrpo_ray.config.sections import LoraConfig
from cagrpo_ray.learner.logprobs import chunk_positions
from cagrpo_ray.learner.sizes import REDUCE_BUCKET_ELEMENTS
from cagrpo_ray.plan.shapes import ModelShape
from cagrpo_ray.rollout.vllm_lora import adapter_slots, vllm_max_lora_rank

GiB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# CUDA context, cuBLAS and NCCL workspaces and caching-allocator slack of a learner rank: an
# allowance, not a measurement (a CUDA context alone takes 0.3-0.6 GiB).
CUDA_CONTEXT_BYTES = int(1.5 * GiB)
# DeepSpeed's stage-0 gradient all-reduce flattens gradients in buckets of this many elements
# (engine.allreduce_gradients' MEMORY_OPT_ALLREDUCE_SIZE).
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
# ZeRO-3 prefetches up to this many parameter elements ahead (stage3_prefetch_bucket_size).
PREFETCH_ELEMENTS = 50_000_000
# Per row and token of a learner's batch shard on its device: input ids and attention mask
# (int64), the response mask, behavior/proximal/reference log-probs, entropies and the loss's
# prepared per-token tensors (float32).
BATCH_BYTES_PER_CELL = 48
# vLLM's memory profile on an 80 GB H100/H200 (vllm/engine/arg_utils.py defaults of the LLM
# class): a forward pass over this many tokens, then the sampler over this many sequences.
VLLM_PROFILE_TOKENS = 16384
VLLM_PROFILE_SEQUENCES = 1024
# vLLM's CUDA graphs, CUDA context and NCCL buffers: an allowance, not a measurement.
VLLM_GRAPHS_AND_CONTEXT_BYTES = 2 * GiB


@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    phase: str  # "resident", "backward" or "step"
    note: str  # where the number comes from


@dataclass(frozen=True)
class Estimate:
    """A GPU's (or a CPU actor's) memory by component; `detail` holds derived numbers."""

    components: tuple[Component, ...]
    detail: dict = field(default_factory=dict)

    def phase_total(self, phase: str) -> int:
        return sum(c.bytes for c in self.components if c.phase == phase)

    @property
    def total(self) -> int:
        """Peak bytes: resident + the larger of the backward and the step transients."""
        return self.phase_total("resident") + max(
            self.phase_total("backward"), self.phase_total("step")
        )

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)

    def largest(self) -> Component:
        return max(self.components, key=lambda c: c.bytes)


# ----------------------------------------------------------------------------- LoRA


def lora_targets(shape: ModelShape, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a decoder layer that `lora.target_modules` names."""
    layers = shape.linear_layers()
    unknown = [name for name in lora.target_modules if name not in layers]
    if unknown:
        raise ValueError(
            f"model.lora.target_modules {unknown} are not linear layers the planner knows; "
            f"allowed: {', '.join(layers)}"
        )
    return {name: layers[name] for name in lora.target_modules}


def lora_parameters(shape: ModelShape, lora: LoraConfig) -> int:
    """T, the adapter's parameters: per layer and target, A [r, in] and B [out, r]."""
    per_layer = sum(i + o for i, o in lora_targets(shape, lora).values())
    return shape.layers * lora.rank * per_layer


def lora_activation_bytes(shape: ModelShape, lora: LoraConfig, s: int) -> int:
    """What LoRA changes in the bytes per token one decoder layer saves for backward
    (`layer_activation_bytes`): each target's float32 A x (4r) and, on a bfloat16 base, the
    float32 copy of its input that PEFT makes for A (4 x in; on a float32 base the input the
    full model keeps serves); less the two RMSNorms' normalized x*r (2sH), kept only for their
    weights' gradients, which the frozen base has not."""
    targets = lora_targets(shape, lora).values()
    adapters = sum(4 * lora.rank + (4 * i if s < 4 else 0) for i, _ in targets)
    return adapters - 2 * s * shape.hidden_size


def lora_slots(config: Config) -> int:
    """Adapters a vLLM generator keeps registered (its `max_loras`): the generators' own rule,
    `adapter_slots` (the versions a request in flight may have started with, and the one being
    registered)."""
    return adapter_slots(config.run.max_staleness)


def lora_slot_bytes(config: Config, shape: ModelShape) -> int:
    """vLLM's LoRA buffers on one TP rank: per slot and targeted layer, A [r', in] and B
    [out, r'] stacked in the model dtype, r' the rank vLLM pads r up to (`vllm_max_lora_rank`),
    counted whole: an upper bound under tensor parallelism."""
    s = DTYPE_BYTES[config.model.dtype]
    padded = config.model.lora.model_copy(
        update={"rank": vllm_max_lora_rank(config.model.lora.rank)}
    )
    return lora_slots(config) * s * lora_parameters(shape, padded)


# ----------------------------------------------------------------------------- activations


def layer_activation_bytes(shape: ModelShape, s: int) -> int:
    """Bytes per token that one decoder layer (Qwen2/Llama, SDPA attention) saves for backward.

    Read from transformers 5.19's Qwen2DecoderLayer and torch's autograd formulas (a product
    saves only the operands the other side needs, so RoPE's cos/sin products keep nothing of
    q and k); measured within 3% on CPU (tests/test_plan_memory.py):

    - each RMSNorm: its float32 input (4H; the input itself when s = 4), the normalized x*r in
      the model dtype (sH, its weight's gradient) and the output (sH, the next matmul's input);
    - attention: q after RoPE, k and v (repeated to all heads when there are fewer KV heads,
      because the learner's right-padded batches pass a mask and transformers repeats them
      then), the SDPA output and its contiguous copy (the o-projection's input): 5 x s x
      heads x head_dim, plus SDPA's float32 log-sum-exp per head; no [w, w] score matrix
      (flash or memory-efficient SDPA);
    - MLP: gate and up outputs, SiLU(gate) and the product (down's input): 4 x sI.
    """
    norm = (4 + 2 * s) * shape.hidden_size
    kv = shape.attention_width if shape.num_kv_heads < shape.num_heads else shape.kv_width
    attention = s * (3 * shape.attention_width + 2 * kv) + 4 * shape.num_heads
    mlp = 4 * s * shape.intermediate_size
    return 2 * norm + attention + mlp


def activation_bytes(
    shape: ModelShape, s: int, rows: int, width: int, checkpointing: bool, adapter: int = 0
):
    """Bytes alive at the start of backward for one micro-batch of `rows` x `width` tokens;
    `adapter`: a LoRA adapter's bytes per token and layer (`lora_activation_bytes`).

    Without checkpointing every layer keeps `layer_activation_bytes`. With it (non-reentrant,
    per decoder layer) a layer keeps only its input (sH per token) and the backward pass
    recomputes one layer at a time, so one layer's activations are added once. Either way:
    the final norm, RoPE's cos and sin, and the [rows, 1, w, w] boolean attention mask.
    """
    tokens = rows * width
    layer = layer_activation_bytes(shape, s) + adapter
    per_token_once = (4 + 2 * s) * shape.hidden_size + 2 * shape.head_dim * s
    if checkpointing:
        kept = shape.layers * s * shape.hidden_size + layer
    else:
        kept = shape.layers * layer
    return tokens * (kept + per_token_once) + rows * width * width


def logits_bytes(
    shape: ModelShape, s: int, tokens: int, budget_mib: float, head_gradient: bool = True
) -> int:
    """The output head's work in backward (learner/logprobs.py): one chunk of positions whose
    backward holds five float32 [positions, V] tensors (logits, exp(z - logsumexp), the gather's
    gradient and their sum; measured 1.65 x the chunk budget, which counts three) plus, for
    bfloat16, the head's output and its gradient; and the head weight's gradient summed over the
    chunks (autograd's buffer plus one chunk's new gradient, 2 x V x H x s), unless the head is
    frozen (`head_gradient` False: LoRA)."""
    positions = min(tokens, chunk_positions(shape.vocab_size, budget_mib))
    per_position = shape.vocab_size * (20 + (2 * s if s < 4 else 0))
    head = 2 * shape.vocab_size * shape.hidden_size * s if head_gradient else 0
    return positions * per_position + head


# ----------------------------------------------------------------------------- learner


def learner_memory(config: Config, shape: ModelShape, device: str = "cuda") -> Estimate:
    """One learner rank's peak memory in a training step, by component.

    device "cuda": torch's AdamW takes its foreach path (one float32 temporary as large as the
    optimizer's partition) and a CUDA context allowance is added; "cpu": the single-tensor
    path (two temporaries as large as the largest optimizer tensor), no context.
    """
    lc, s = config.learner, DTYPE_BYTES[config.model.dtype]
    p, n, stage = shape.parameters(), lc.num_learners, lc.zero_stage
    lora = config.model.lora if config.model.lora.enabled else None
    # t: the trained parameters; bf16: mixed precision (bfloat16 weights, float32 master);
    # g: the trained parameters' (and their gradients') bytes
    if lora:
        t, bf16, g = lora_parameters(shape, lora), False, 4
        largest_trained = lora.rank * max(max(io) for io in lora_targets(shape, lora).values())
    else:
        t, bf16, g, largest_trained = p, s < 4, s, shape.largest_tensor()
    r = config.rollout
    rows_per_rank = math.ceil(r.prompts_per_step / n) * r.group_size
    rows = min(lc.micro_batch_size, rows_per_rank)
    width = r.max_model_len
    comps: list[Component] = []

    def add(name: str, nbytes: float, phase: str, note: str) -> None:
        comps.append(Component(name, int(nbytes), phase, note))

    # model states (P: t below, the trained parameters: all, or the adapter's T)
    if stage == 3:
        weights = s * (p / n + shape.persistent_parameters())
        add("weights", weights, "resident", "sP/N, plus the small tensors ZeRO-3 keeps whole")
    else:
        add("weights", s * p, "resident", "sP: every rank holds the whole model")
    if lora:
        add("adapter", 4 * t, "resident", f"4T: the LoRA adapter (rank {lora.rank}), float32")
    if stage == 0:
        add("gradients", 4 * t, "resident", "4P: float32 gradients of every trained parameter")
        add("optimizer", 8 * t, "resident", "8P: AdamW's two moments (the weights are fp32)")
    else:
        if stage == 1 and bf16:
            grads, note = 6 * t, "BF16_Optimizer: 4P float32 accumulation buffer + 2P bf16 grads"
        else:
            grads, note = 4 * t / n, "4P/N: this rank's float32 gradient partition"
        add("gradients", grads, "resident", note)
        master = 0 if (stage == 3 and not bf16) else 4 * t / n
        add("optimizer", master + 8 * t / n, "resident", "fp32 master partition + 2 moments")
    if config.algorithm.kl_coef > 0 and not lora:  # LoRA's reference: the adapter switched off
        ref = s * (p / n + shape.persistent_parameters()) if stage == 3 else s * p
        add("reference", ref, "resident", "the frozen reference policy (kl_coef > 0)")

    # gradient reduction buffers
    reduce_elements = min(t, REDUCE_BUCKET_ELEMENTS)
    if stage == 3:
        add("reduce_bucket", g * REDUCE_BUCKET_ELEMENTS, "resident", "ZeRO-3's reduce bucket")
        gathered_gradient = 0 if lora else shape.largest_tensor()
        gathered = s * (shape.largest_tensor() + gathered_gradient + min(p, PREFETCH_ELEMENTS))
        what = "largest gathered tensor" + ("" if lora else " + its gradient") + ", prefetch"
        add("gathered", gathered, "backward", what)
        add(
            "reduce",
            g * reduce_elements + 4 * reduce_elements / n,
            "backward",
            "a flat copy of the bucket's gradients, its float32 partition",
        )
    elif stage in (1, 2) and not (stage == 1 and bf16):
        add(
            "reduce_bucket",
            g * (REDUCE_BUCKET_ELEMENTS + t / n),
            "backward",
            "ZeRO-1/2 reduce bucket (every backward) + a flat copy of the partition",
        )

    # one micro-batch
    add(
        "activations",
        activation_bytes(
            shape,
            s,
            rows,
            width,
            lc.gradient_checkpointing,
            lora_activation_bytes(shape, lora, s) if lora else 0,
        ),
        "backward",
        f"{rows} x {width} tokens"
        + (", checkpointed per layer" if lc.gradient_checkpointing else ""),
    )
    add(
        "logits",
        logits_bytes(shape, s, rows * width, lc.logits_chunk_mib, head_gradient=not lora),
        "backward",
        f"learner.logits_chunk_mib {lc.logits_chunk_mib:g} chunk + head gradient",
    )
    add(
        "batch",
        BATCH_BYTES_PER_CELL * rows_per_rank * width,
        "backward",
        f"{rows_per_rank} rows of the step's batch shard",
    )

    # after the last backward
    optimizer_tensor = t if stage == 0 else t / n
    if device == "cuda":
        adam = 4 * optimizer_tensor
    else:
        adam = 2 * 4 * (largest_trained if stage == 0 else optimizer_tensor)
    if stage == 0 or (stage == 1 and bf16):
        flatten = 4 * min(t, ALLREDUCE_BUCKET_ELEMENTS)  # the all-reduce's flat gradients
        add("optimizer_step", max(flatten, adam), "step", "all-reduce's flat grads, or AdamW")
    elif stage == 3:
        add("optimizer_step", 4 * t / n + adam, "step", "flat fp32 gradient partition + AdamW")
    else:
        add("optimizer_step", adam + (0 if bf16 else 4 * t / n), "step", "AdamW's temporaries")
    if device == "cuda":
        add("cuda_context", CUDA_CONTEXT_BYTES, "resident", "allowance: context, workspaces")
    return Estimate(
        tuple(comps),
        {
            "rows": rows,
            "width": width,
            "tokens": rows * width,
            "parameters": p,
            "trained_parameters": t,
        },
    )


# ----------------------------------------------------------------------------- generator


def kv_bytes_per_token(shape: ModelShape, s: int, tp: int) -> int:
    """KV cache of one token on one TP rank: keys and values of every layer; KV heads are
    split over the TP ranks (replicated when there are fewer heads than ranks)."""
    heads_per_rank = max(1, shape.num_kv_heads // tp)
    return 2 * shape.layers * heads_per_rank * shape.head_dim * s


def generator_memory(config: Config, shape: ModelShape, gpu_memory_bytes: int) -> Estimate:
    """One TP rank of a vLLM generator replica: vLLM takes `rollout.gpu_memory_utilization`
    of the GPU, and what its weights, profiled activations and CUDA graphs leave is KV cache.

    `detail` says how many full `rollout.max_model_len` sequences the KV cache holds.
    """
    r, s = config.rollout, DTYPE_BYTES[config.model.dtype]
    tp = r.tensor_parallel_size
    budget = int(r.gpu_memory_utilization * gpu_memory_bytes)
    h, i = shape.hidden_size, shape.intermediate_size
    weights = s * shape.parameters() / tp
    # the profile's forward pass: residual, normed input and the MLP's gate/up and SiLU
    # outputs per token; then the sampler: float32 logits, probabilities and a sort
    # (values and int64 indices) per sequence
    forward = VLLM_PROFILE_TOKENS * s * (2 * h + 3 * i / tp + (shape.attention_width / tp))
    sampler = VLLM_PROFILE_SEQUENCES * shape.vocab_size * 20
    comps = [
        Component("weights", int(weights), "resident", f"sP/{tp} (tensor parallel)"),
        *_lora_slots_component(config, shape),
        Component(
            "activations",
            int(forward + sampler),
            "resident",
            f"vLLM's profile: {VLLM_PROFILE_TOKENS} tokens, sampler over "
            f"{VLLM_PROFILE_SEQUENCES} sequences",
        ),
        Component(
            "cuda_graphs",
            VLLM_GRAPHS_AND_CONTEXT_BYTES,
            "resident",
            "allowance: CUDA graphs, context, NCCL",
        ),
    ]
    kv = budget - sum(c.bytes for c in comps)
    comps.append(Component("kv_cache", kv, "resident", "what is left of vLLM's share"))
    per_sequence = kv_bytes_per_token(shape, s, tp) * r.max_model_len
    return Estimate(
        tuple(comps),
        {
            "vllm_share_bytes": budget,
            "kv_bytes_per_sequence": per_sequence,
            "kv_sequences": max(0.0, kv / per_sequence),
        },
    )


def _lora_slots_component(config: Config, shape: ModelShape) -> list[Component]:
    if not config.model.lora.enabled:
        return []
    slots = lora_slots(config)
    note = f"{slots} LoRA slots (run.max_staleness + 2) of rank {config.model.lora.rank}"
    return [Component("lora_slots", lora_slot_bytes(config, shape), "resident", note)]


def cpu_generator_memory(config: Config, shape: ModelShape) -> Estimate:
    """A vLLM generator on the CPU: its weights and the configured KV cache."""
    s = DTYPE_BYTES[config.model.dtype]
    return Estimate(
        (
            Component("weights", s * shape.parameters(), "resident", "sP"),
            *_lora_slots_component(config, shape),
            Component(
                "kv_cache",
                int(config.rollout.kv_cache_gib * GiB),
                "resident",
                "rollout.kv_cache_gib",
            ),
        )
    )
