"""Methods added to every vLLM worker, called through `LLM.collective_rpc(name, args=...)`.

vLLM mixes this class into its worker class when the engine is built with
`worker_extension_cls="cagrpo_ray.rollout.worker_extension.WeightSyncExtension"`, so `self` is
the worker: `self.rank` is the worker's rank inside its engine (0 .. tensor-parallel size - 1)
and `self.model_runner` holds the model. Only control values travel as RPC arguments; weights
travel through the weight-sync process group (`cagrpo_ray.sync`).

Weights go in through vLLM's in-place reload (`Worker.reload_weights`), not the model's bare
`load_weights`: on the CPU, vLLM repacks every linear layer's weight for its GEMM kernels after
loading and replaces the original parameter with an empty one, so a bare `load_weights` fails
(the empty parameter has no `weight_loader`); the reload path rebuilds each layer from the
checkpoint-format tensors and runs that processing again. A whole sync goes through one reload
call, because a layer whose tensors straddle two buckets (q, k, v of one attention block, say)
is processed only once all of them are in.

What the reload says, and what it means:
- A tied `lm_head` shares its weight with the token embedding, but checkpoints carry no
  `lm_head.weight` when tied, so the reload would leave the head untouched (and on the CPU
  keep its old packed GEMM: the engine would sample from new hidden states through the old
  head). The embedding tensor is therefore also given as `lm_head.weight`.
- A rotary embedding holds only a non-persistent buffer computed from the config, which no
  checkpoint carries: vLLM logs "RotaryEmbedding: Failed to load weights" at every reload and
  keeps the (correct) buffer. That line is expected and dropped.
- Any other layer that received nothing is a real failure: the sync raises, naming it.
- The receiver hands over a whole version at once, staged in host memory, and only once the
  learner has confirmed its send (`sync/receiver.py`): a sync that fails mid-transfer (a peer
  or the learner died) is a plain `WeightSyncError` raised before the reload starts, and the
  worker keeps serving the previous version intact.
- An exception inside the reload itself leaves the model half-loaded (vLLM does not roll
  back): the error says "model left unusable", and the generator exits so that Ray restarts it.

Under LoRA the base weights never change: `receive_adapter` stages the adapter's tensors in
host memory and registers them with vLLM's LoRA manager under a new id once all are in, and
`served_adapter_checksum` reads the registered adapter back for the sync's acknowledgement
(`vllm_lora.py`). A full reload would drop every registered adapter (vLLM resets its LoRA
state after one), so an engine serving adapters takes none.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator

import torch

from cagrpo_ray.sync import SyncAddress, WeightReceiver

# In a sync error's message: the model is half-loaded and the engine must be rebuilt.
MODEL_UNUSABLE = "model left unusable"


class WeightSyncExtension:
    """Weight-sync receiver, direct loading and read-back for a vLLM worker."""

    def init_weight_sync(self, address: dict, rank_offset: int) -> int:
        """Join the learner's weight-sync group as rank `rank_offset + self.rank`; return it.

        `address` is `dataclasses.asdict(SyncAddress)`; plain values cross the RPC unchanged.
        """
        rank = rank_offset + self.rank
        previous = getattr(self, "weight_receiver", None)
        if previous is not None:
            # A rebuilt group: the old one's NCCL communicator is freed only by an explicit
            # close (a dropped reference keeps its GPU memory and threads).
            previous.close()
            self.weight_receiver = None
        self.weight_receiver = WeightReceiver(SyncAddress(**address), rank)
        return rank

    def receive_weights(self, version: int, record_digests: bool = False) -> dict:
        """Receive policy `version` from the learner into this worker's model: one reload of
        the whole version, staged by the receiver; a transfer that fails raises a
        `WeightSyncError` with the previous version still loaded.

        Returns {"version", "num_bytes", "seconds"} and, with `record_digests`, "digests": the
        sha256 of each tensor as received, by the sender's name (to check a transfer bit for
        bit, including the linear layers whose weights vLLM's CPU kernels keep packed).
        """
        receiver = getattr(self, "weight_receiver", None)
        if receiver is None:
            raise RuntimeError(
                f"vLLM worker {self.rank}: receive_weights({version}) before init_weight_sync"
            )
        digests: dict[str, str] = {}

        def load(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
            self._reload(_digesting(named_tensors, digests) if record_digests else named_tensors)

        stats = receiver.receive(version, load)
        self.policy_version = version
        result = {"version": version, "num_bytes": stats.num_bytes, "seconds": stats.seconds}
        if record_digests:
            result["digests"] = digests
        return result

    def receive_adapter(self, version: int, lora_id: int, spec: dict) -> dict:
        """Receive policy `version` as a LoRA adapter (PEFT-named tensors, `LoraSpec` `spec`
        as a dict) and register it in vLLM's LoRA manager as `lora_id` (`vllm_lora.py`).

        Staged by the receiver (a whole version, confirmed by the learner, before `load`), so
        a failed transfer leaves every registered adapter as it was; the tensors are copied
        out of the receive buffers, which the next sync reuses, into host memory, where vLLM
        keeps registered adapters. A failed registration reaches the learner's send as this
        worker's error. Returns {"version", "num_bytes", "seconds"}.
        """
        from cagrpo_ray.policies.lora import LoraSpec
        from cagrpo_ray.rollout.vllm_lora import register_adapter

        receiver = getattr(self, "weight_receiver", None)
        if receiver is None:
            raise RuntimeError(
                f"vLLM worker {self.rank}: receive_adapter({version}) before init_weight_sync"
            )
        lora = LoraSpec(**spec)
        staged: dict[str, torch.Tensor] = {}

        def load(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in named_tensors:
                staged[name] = tensor.to("cpu", copy=True)
            register_adapter(self.model_runner, lora_id, staged, lora)

        stats = receiver.receive(version, load)
        self.adapter_sent = staged  # what served_adapter_checksum compares the registry with
        self.policy_version = version
        return {"version": version, "num_bytes": stats.num_bytes, "seconds": stats.seconds}

    def load_serialized_adapter(
        self, lora_id: int, spec: dict, weights: list[tuple[str, str, list[int], bytes]]
    ) -> int:
        """Register (name, dtype name, shape, raw bytes) adapter tensors as `lora_id`: the
        off-hot-path way in, as `load_serialized_weights`. Returns the count."""
        from cagrpo_ray.policies.lora import LoraSpec
        from cagrpo_ray.rollout.vllm_lora import register_adapter

        tensors = {name: tensor for name, tensor in _deserialized(weights)}
        register_adapter(self.model_runner, lora_id, tensors, LoraSpec(**spec))
        self.adapter_sent = tensors
        return len(tensors)

    def served_adapter_checksum(self, lora_id: int, spec: dict) -> str:
        """`adapter_checksum` of the adapter registered as `lora_id`, compared tensor by tensor
        with the last adapter received (`vllm_lora.served_checksum` says what is hashed)."""
        from cagrpo_ray.policies.lora import LoraSpec
        from cagrpo_ray.rollout.vllm_lora import served_checksum

        sent = getattr(self, "adapter_sent", {})
        return served_checksum(self.model_runner, lora_id, sent, LoraSpec(**spec))

    def load_serialized_weights(self, weights: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load (name, dtype name, shape, raw bytes) tuples: the off-hot-path way in, for
        tests and one-off loads where a sync group would be overkill. Returns the count."""
        tensors = list(_deserialized(weights))
        self._reload(tensors)
        return len(tensors)

    def _reload(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False):
            named_tensors = _with_tied_head(named_tensors)
        with _ReloadLog() as log:
            try:
                self.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
            except Exception as exc:
                raise RuntimeError(f"{MODEL_UNUSABLE} by a failed reload: {exc}") from exc
        if log.unloaded:
            raise RuntimeError(
                f"vLLM worker {self.rank}: layers that received no weights in this sync (they "
                f"keep the previous version's): {', '.join(sorted(set(log.unloaded)))}"
            )

    def parameter_digests(self) -> dict[str, str]:
        """sha256 of the bytes of every parameter that vLLM keeps as a tensor, by vLLM name.

        Embedding tables are cut to the vocabulary (vLLM pads them to a multiple of 64 rows).
        On the CPU, linear layers keep only their packed kernel weights, not a parameter, so
        they are absent here; `receive_weights(..., record_digests=True)` covers them.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.get_model()
        rows = {
            f"{name}.weight": module.shard_indices.num_org_elements
            for name, module in model.named_modules()
            if isinstance(module, VocabParallelEmbedding)
        }
        digests = {}
        for name, param in model.named_parameters():
            if param.numel() == 0:
                continue
            digests[name] = tensor_digest(param[: rows[name]] if name in rows else param)
        return digests


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (row-major), the same on every rank for equal tensors."""
    data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()


def _deserialized(
    weights: list[tuple[str, str, list[int], bytes]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype, shape, raw in weights:
        yield name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(shape)


def _digesting(
    named_tensors: Iterable[tuple[str, torch.Tensor]], digests: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named_tensors:
        digests[name] = tensor_digest(tensor)
        yield name, tensor


def _with_tied_head(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, with the token embedding also given as the tied `lm_head.weight`."""
    for name, tensor in named_tensors:
        yield name, tensor
        if name.endswith("embed_tokens.weight"):
            yield "lm_head.weight", tensor


class _ReloadLog(logging.Filter):
    """Watches vLLM's layer-wise reload log for the duration of a reload: drops the expected
    rotary-embedding line, collects every other layer that received no weights."""

    LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

    def __init__(self):
        super().__init__()
        self.unloaded: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        if layer.endswith("RotaryEmbedding"):
            return False  # a buffer computed from the config: nothing to load, nothing lost
        self.unloaded.append(layer)
        return True

    def __enter__(self) -> _ReloadLog:
        logging.getLogger(self.LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)
