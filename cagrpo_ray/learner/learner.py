"""One data-parallel learner rank: a DeepSpeed engine around the policy and its update step.

`Learner` is a plain class; `cagrpo_ray.learner.group` runs m of them as Ray actors. Every rank
receives its shard of the learner batch (whole prompt groups, see docs/architecture.md) and
takes part in every collective, so all ranks call the same methods in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.algo import (
    LossSpec,
    lr_factor,
)
from cagrpo_ray.learner.batch import BATCH_KEYS
from cagrpo_ray.learner.distributed import (
    all_reduce_,
    deepspeed_config,
    init_data_parallel,
    rng_state,
    seed_everything,
    set_rng_state,
)
from cagrpo_ray.learner.ppo import PPOSteps
from cagrpo_ray.learner.scorer import TokenScorer, keep_head_gathered
from cagrpo_ray.learner.settings import LearnerSettings

_CHECKPOINT_TAG = "learner"


class Learner(PPOSteps):
    """One rank of the data-parallel policy learner (DeepSpeed ZeRO stage 0 to 3).

    `train_step` (ppo.py) is one learner step on the rank's shard of a rollout batch: by
    default one optimizer step on the whole batch, or `ppo_epochs` passes over its
    mini-batches; each update's loss is normalised over its (mini-)batch across ranks, so it
    does not depend on how the batch is cut into micro-batches and ranks.
    """

    def __init__(
        self,
        settings: LearnerSettings,
        loss: LossSpec | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ) -> None:
        loss = loss or LossSpec()
        if settings.num_threads > 0:
            torch.set_num_threads(settings.num_threads)
        self.settings, self.loss = settings, loss
        self.model_path = str(settings.model_path)
        self.rank, self.world_size = rank, world_size
        self.zero_stage = settings.zero_stage
        self.micro_batch_size = settings.micro_batch_size
        self.temperature = settings.temperature
        self.step = 0
        self.weight_sender = None  # rank 0's end of the weight sync, once opened

        init_data_parallel(rank, world_size, master_addr, master_port, settings.dist_timeout_s)
        seed_everything(settings.seed)
        self.ds_config = deepspeed_config(
            settings.zero_stage,
            settings.micro_batch_size,
            world_size,
            settings.grad_clip,
            bf16=settings.dtype == "bfloat16",
        )
        model = self._load_model(self.model_path)
        # No weight decay on biases and norms, as usual for transformers.
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": settings.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=settings.lr,
        )
        # Linear warm-up from lr / warmup_steps on the first step to lr, then the schedule. It
        # counts learner steps: DeepSpeed steps it at every optimizer step, and a learner step
        # takes ppo_epochs x mini_batches of those.
        updates = settings.ppo_epochs * settings.mini_batches
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(
                s // updates,
                settings.total_steps,
                settings.warmup_steps,
                settings.lr_schedule,
                settings.min_lr_ratio,
            ),
        )
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
        )
        if self.zero_stage == 3:
            keep_head_gathered(model)
        self.device = self.engine.device
        self.ref_model = None
        ref_path = settings.ref_model_path or (self.model_path if loss.kl_coef > 0 else None)
        if ref_path is not None:
            self.ref_model = self._reference_model(str(ref_path))

    # ----------------------------------------------------------------------------- set-up

    def _load_model(self, path: str, trainable: bool = True) -> TokenScorer:
        s = self.settings
        # Every rank loads the whole model into host memory; under ZeRO-3 deepspeed.initialize
        # then partitions it. (Building it already partitioned needs transformers'
        # HfDeepSpeedConfig, which requires the accelerate package.)
        config = AutoConfig.from_pretrained(path)
        # Dropout off for good: the recomputed proximal log-probs and the training forward pass
        # must be the same function of the weights (ratio 1 on the first pass), as usual in RL
        # fine-tuning. The model stays in train mode, which transformers needs for gradient
        # checkpointing (it checkpoints only when `self.training`).
        for name, value in config.to_dict().items():
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)
        config.use_cache = False
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=getattr(torch, s.dtype)
        )
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if trainable and s.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train(trainable)
        return TokenScorer(model, self.temperature, s.logits_chunk_mib)

    def _reference_model(self, path: str) -> torch.nn.Module:
        model = self._load_model(path, trainable=False).requires_grad_(False)
        if self.zero_stage == 3:
            config = {
                "train_micro_batch_size_per_gpu": self.micro_batch_size,
                "zero_optimization": {"stage": 3},
                "bf16": self.ds_config["bf16"],
                "steps_per_print": self.ds_config["steps_per_print"],
            }
            engine, _, _, _ = deepspeed.initialize(model=model, config=config)
            keep_head_gathered(model)
            return engine
        return model.to(self.device)

    # ----------------------------------------------------------------------------- forward

    def _micro_batches(
        self, lengths: torch.Tensor, count: int | None = None, groups: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Row indices of each micro-batch (`count` of them, or as many as
        `micro_batch_size` needs), rows sorted by length so that a micro-batch's padding,
        which its forward pass trims, is small. With `groups` (the rows' prompt group ids)
        and `share_prompts`, a group's rows stay together (groups sorted by their longest
        row), so that a micro-batch runs each prompt once. The same number on every rank
        (ZeRO's collectives run inside forward and backward, so every rank runs as many)."""
        rows = lengths.numel()
        wanted = count if count is not None else math.ceil(rows / self.micro_batch_size)
        wanted = torch.tensor([wanted], device=self.device)
        wanted = int(all_reduce_(wanted, "max").item())
        lengths = lengths.cpu()
        if groups is not None and self.settings.share_prompts:
            groups = groups.cpu()
            _, group_index = torch.unique_consecutive(groups, return_inverse=True)
            longest = torch.zeros(int(group_index.max()) + 1, dtype=lengths.dtype)
            longest = longest.scatter_reduce(0, group_index, lengths, "amax")
            # groups by their longest row (ascending), then by length within a group
            key = (longest[group_index] * (rows + 1) + group_index) * (int(lengths.max()) + 1)
            order = torch.argsort(key + lengths, stable=True)
        else:
            order = torch.argsort(lengths, stable=True)
        return list(order.tensor_split(wanted))

    def _groups(self, batch, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows' prompt group ids where prompts are shared (`share_prompts`), else None."""
        if not self.settings.share_prompts:
            return None
        return batch["group_ids"] if rows is None else batch["group_ids"][rows]

    def _scores(self, model, batch, rows: torch.Tensor, with_entropy: bool):
        """[r, W] log-probs at the token (and entropies, or None) of the micro-batch `rows`,
        W the batch's width; 0 outside the rows' response tokens."""
        attention_mask = batch["attention_mask"][rows]
        # Cut the padding columns that no row of this micro-batch uses.
        used = int(attention_mask.any(0).nonzero().max().item()) + 1
        width = attention_mask.shape[1]
        logprobs, entropy = model(
            input_ids=batch["input_ids"][rows, :used],
            attention_mask=attention_mask[:, :used],
            with_entropy=with_entropy,
            wanted=batch["response_mask"][rows, :used],  # the head on response tokens only
            groups=self._groups(batch, rows),
        )
        logprobs = F.pad(logprobs, (0, width - used))
        return logprobs, None if entropy is None else F.pad(entropy, (0, width - used))

    # ----------------------------------------------------------------------------- update

    def _max_response_length(self, mask: torch.Tensor) -> int:
        """Dr.GRPO's constant L: the configured one, else the longest response in the batch."""
        if self.settings.max_response_length is not None:
            return self.settings.max_response_length
        longest = mask.sum(1).max().reshape(1)
        return int(all_reduce_(longest, "max").item())

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: v.to(self.device) for k, v in batch.items() if k in BATCH_KEYS}
        out["response_mask"] = out["response_mask"].bool()
        out["behavior_logprobs"] = out["behavior_logprobs"].float()
        out["rewards"] = out["rewards"].float()
        out["advantages"] = out["advantages"].float()
        return out

    @torch.no_grad()
    def _score(self, batch, micro, full: bool = True, ref_only: bool = False):
        """Recomputed log-probs, token entropies, and reference log-probs (None without a
        reference policy), each [B, L], under no_grad, micro-batch by micro-batch. With
        `full=False` only the log-probs (entropy and reference are None); with `ref_only` only
        the reference's (the others None)."""
        logprobs = None if ref_only else torch.zeros_like(batch["behavior_logprobs"])
        entropy = torch.zeros_like(batch["behavior_logprobs"]) if full else None
        want_ref = (full or ref_only) and self.ref_model is not None
        ref = torch.zeros_like(batch["behavior_logprobs"]) if want_ref else None
        for rows in micro:
            rows = rows if rows.numel() else torch.zeros(1, dtype=torch.long)
            if not ref_only:
                values, token_entropy = self._scores(self.engine, batch, rows, full)
                logprobs[rows] = values
                if full:
                    entropy[rows] = token_entropy
            if ref is not None:
                ref[rows] = self._scores(self.ref_model, batch, rows, False)[0]
        return logprobs, entropy, ref

    def _grad_norm_before_step(self) -> float | None:
        """Stage 0 only: the global norm of the averaged gradients before clipping (ZeRO
        optimizers report it themselves in `_grad_norm_after_step`)."""
        if self.zero_stage != 0:
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    def _grad_norm_after_step(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # ----------------------------------------------------------------------------- weights

    def iter_sync_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, full tensor) on rank 0, for the weight broadcast.

        Every rank must iterate to the end: under ZeRO-3 each parameter is gathered from all
        ranks in turn. Other ranks yield nothing. Tied weights appear once (under the name of
        the embedding), as `load_weights` of vLLM and `load_state_dict(strict=False)` expect.
        The tensors are copies under ZeRO-3 (the gathered storage is freed after each one) and
        the live parameters otherwise, so a consumer that keeps them must copy them.
        """
        for name, param in self.engine.module.policy.named_parameters():
            if self.zero_stage == 3:
                with deepspeed.zero.GatheredParameters([param]):
                    if self.rank == 0:
                        yield name, param.detach().clone()
            elif self.rank == 0:
                yield name, param.detach()

    def open_weight_sender(
        self, host: str, world_size: int, backend: str, timeout_s: float, bucket_mb: float
    ) -> dict | None:
        """On rank 0: (re)start the weight-sync group's store on `host` and return its address
        (`SyncAddress` as a dict) for the generators to join; None on the other ranks."""
        if self.rank != 0:
            return None
        from cagrpo_ray.sync import WeightSender

        if self.weight_sender is not None:
            self.weight_sender.close()
        self.weight_sender = WeightSender(
            host=host,
            port=0,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
            bucket_mb=bucket_mb,
        )
        return asdict(self.weight_sender.address)

    def send_weights(self, version: int) -> dict:
        """Broadcast the current weights as `version` to the generators. Every rank must call
        it (ZeRO-3 gathers each parameter from all ranks); rank 0 sends. Returns rank 0's
        `SyncStats` as a dict, or {"error": ...} when the sync failed ({} on other ranks).

        Rank 0 first waits until every generator worker is there (at most sync.timeout_s) and
        then releases the other ranks: before that, they would sit in the first parameter
        gather, on DeepSpeed's collective timeout, holding gathered memory.
        """
        from cagrpo_ray.sync import WeightSyncError

        error = None
        if self.rank == 0:
            if self.weight_sender is None:
                raise RuntimeError("send_weights before open_weight_sender")
            try:
                self.weight_sender.announce(version)
            except WeightSyncError as exc:
                error = str(exc)
        go = torch.tensor([0 if error else 1], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(go, src=0)
        if not int(go.item()):
            return {"error": error} if self.rank == 0 else {}
        tensors = self.iter_sync_weights()
        if self.rank != 0:
            for _ in tensors:
                pass
            return {}
        try:
            stats = self.weight_sender.send(tensors, version)
        except WeightSyncError as exc:
            for _ in tensors:  # keep every rank's ZeRO-3 gathers matched
                pass
            return {"error": str(exc)}
        return asdict(stats)

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """All of `iter_sync_weights` as one CPU dict on rank 0 (empty on other ranks)."""
        return {name: t.to("cpu", copy=True) for name, t in self.iter_sync_weights()}

    def save_hf(self, out_dir: str | Path) -> Path:
        """Write the current policy in the Hugging Face layout (config, safetensors, tokenizer,
        generation config), loadable by transformers and vLLM. Every rank must call it; rank 0
        writes."""
        out = Path(out_dir)
        state = self.state_dict_for_sync()
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            self.engine.module.policy.save_pretrained(
                out, state_dict=state, safe_serialization=True
            )
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out)
        self._barrier()
        return out

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict | None = None) -> None:
        """Save model, optimizer and lr-scheduler state (DeepSpeed layout), the step, the
        caller's `client_state`, and this rank's RNG states. Every rank must call it."""
        ckpt = Path(ckpt_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        state = {"learner_step": self.step, "client_state": dict(client_state or {})}
        self.engine.save_checkpoint(str(ckpt), tag=_CHECKPOINT_TAG, client_state=state)
        torch.save(rng_state(), ckpt / f"rng_rank{self.rank}.pt")
        self._barrier()

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict:
        """Restore what `save_checkpoint` wrote (same world size and ZeRO stage); returns the
        caller's `client_state`. Every rank must call it."""
        ckpt = Path(ckpt_dir)
        if not (ckpt / _CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"no learner checkpoint in {ckpt} (missing {_CHECKPOINT_TAG}/)")
        path, state = self.engine.load_checkpoint(str(ckpt), tag=_CHECKPOINT_TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the learner checkpoint in {ckpt}")
        self.step = int(state["learner_step"])
        set_rng_state(torch.load(ckpt / f"rng_rank{self.rank}.pt", weights_only=False))
        return state["client_state"]

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
