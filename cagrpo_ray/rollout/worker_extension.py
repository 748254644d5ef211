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

One more CPU trap: a tied `lm_head` shares its weight with the token embedding, but its packed
GEMM weight is its own copy, and the reload rebuilds only layers that received tensors (the
embedding, not the head, since checkpoints carry no `lm_head.weight` when tied). Without
`_repack_embedding_gemms` the engine samples from new hidden states through the old head.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch

from cagrpo_ray.sync import SyncAddress, WeightReceiver


class WeightSyncExtension:
    """Weight-sync receiver, direct loading and read-back for a vLLM worker."""

    def init_weight_sync(self, address: dict, rank_offset: int) -> int:
        """Join the learner's weight-sync group as rank `rank_offset + self.rank`; return it.

        `address` is `dataclasses.asdict(SyncAddress)`; plain values cross the RPC unchanged.
        """
        rank = rank_offset + self.rank
        self.weight_receiver = WeightReceiver(SyncAddress(**address), rank)
        return rank

    def receive_weights(self, version: int, record_digests: bool = False) -> dict:
        """Receive policy `version` from the learner into this worker's model.

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

    def load_serialized_weights(self, weights: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load (name, dtype name, shape, raw bytes) tuples: the off-hot-path way in, for
        tests and one-off loads where a sync group would be overkill. Returns the count."""
        tensors = [
            (name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(shape))
            for name, dtype, shape, raw in weights
        ]
        self._reload(tensors)
        return len(tensors)

    def _reload(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
        _repack_embedding_gemms(self.model_runner.get_model())

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


def _digesting(
    named_tensors: Iterable[tuple[str, torch.Tensor]], digests: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named_tensors:
        digests[name] = tensor_digest(tensor)
        yield name, tensor


def _repack_embedding_gemms(model: torch.nn.Module) -> None:
    """Rebuild the CPU GEMM kernels of embedding-shaped layers from their current weights."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # elsewhere the head multiplies by the (shared) parameter itself
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            module.quant_method.process_weights_after_loading(module)
