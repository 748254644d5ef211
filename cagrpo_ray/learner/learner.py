"""One data-parallel learner rank: a DeepSpeed engine around the policy and its update step.

`Learner` is a plain class; `cagrpo_ray.learner.group` runs m of them as Ray actors. Every rank
receives its shard of the learner batch (whole prompt groups, see docs/architecture.md) and
takes part in every collective, so all ranks call the same methods in the same order.

`Learner.train_step` reads as the step runs, each part with explicit inputs:

    1. proximal pass: the current weights' log-probs and entropies, and the reference
       policy's log-probs (`forward.ForwardPasses.proximal`);
    2. off-policy correction: truncated IS weights, generator -> proximal policy
       (`algo/off_policy.py`);
    3. loss preparation: the loss's batch statistics (kernel weights, Clip-Cov/KL-Cov
       selections), once over the rollout batch on all ranks (`algo.prepare_loss_inputs`);
    4. PPO epochs: `ppo_epochs` passes over `mini_batches` mini-batches, one optimizer step
       each (`ppo.ppo_epochs`);
    5. inspection: the inspected groups' per-token values, and optionally the step's KL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cagrpo_ray.algo import (
    LossSpec,
    lr_factor,
    prepare_loss_inputs,
    token_fields,
    truncated_is_weights,
)
from cagrpo_ray.algo.registry import as_spec
from cagrpo_ray.config.plugins import load_plugins
from cagrpo_ray.learner.adapter import (
    BasePolicy,
    adapter_names,
    merged_policy,
    save_adapter,
    with_adapter,
)
from cagrpo_ray.learner.batch import BATCH_KEYS, check_batch
from cagrpo_ray.learner.distributed import (
    RankReducer,
    all_reduce_,
    data_parallel_group,
    deepspeed_config,
    init_data_parallel,
    rng_state,
    seed_everything,
    set_rng_state,
)
from cagrpo_ray.learner.forward import ForwardPasses
from cagrpo_ray.learner.logprobs import TokenLogprobs, keep_head_gathered
from cagrpo_ray.learner.ppo import (
    UpdateInputs,
    combine_updates,
    policy_change,
    ppo_epochs,
    reduce_batch_metric,
    token_records,
)
from cagrpo_ray.learner.settings import LearnerSettings
from cagrpo_ray.policies.lora import adapter_checksum

_CHECKPOINT_TAG = "learner"


def adamw_with_schedule(model: torch.nn.Module, settings: LearnerSettings):
    """AdamW over `model`'s trainable parameters (all of them, or a LoRA adapter's; no weight
    decay on biases and norms, as usual for transformers) and its learning-rate schedule:
    linear warm-up from lr / warmup_steps on the first step to lr, then
    `settings.lr_schedule` (`algo.schedules.lr_factor`). The schedule counts learner steps:
    DeepSpeed steps it at every optimizer step, and a learner step takes ppo_epochs x
    mini_batches of those."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.ndim >= 2]
    no_decay = [p for p in trainable if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # DeepSpeed drops an empty group (a LoRA adapter has no 1-D parameters), and the
    # schedule must see the groups the optimizer keeps.
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=settings.lr)
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
    return optimizer, scheduler


class Learner:
    """One rank of the data-parallel policy learner (DeepSpeed ZeRO stage 0 to 3).

    `train_step` is one learner step on the rank's shard of a rollout batch: by default one
    optimizer step on the whole batch, or `ppo_epochs` passes over its mini-batches; each
    update's loss is normalised over its (mini-)batch across ranks, so it does not depend on
    how the batch is cut into micro-batches and ranks.

    With `settings.lora` it trains a LoRA adapter on the frozen base (`learner/adapter.py`):
    the weight sync, the checkpoints and `save_adapter` then hold the adapter only, and the KL
    reference (unless `ref_model_path` names another policy) is the same model with the
    adapter switched off.
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
        load_plugins(settings.plugins)  # before the loss is looked up
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
        self.inspection: dict[str, np.ndarray] = {}  # the last step's, for the token inspector

        init_data_parallel(rank, world_size, master_addr, master_port, settings.dist_timeout_s)
        seed_everything(settings.seed)
        self.ds_config = deepspeed_config(
            settings.zero_stage,
            settings.micro_batch_size,
            world_size,
            settings.grad_clip,
            # A LoRA adapter trains in float32 beside a frozen bfloat16 base: no mixed
            # precision (which would cast the adapter to bfloat16 too).
            bf16=settings.dtype == "bfloat16" and settings.lora is None,
        )
        model = self._load_model(self.model_path)
        # (saved name, live parameter) of the adapter's tensors; None in full fine-tuning
        self.adapter = adapter_names(model.policy) if settings.lora else None
        optimizer, scheduler = adamw_with_schedule(model, settings)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
        )
        if self.zero_stage == 3:
            keep_head_gathered(model)
        self.device = self.engine.device
        self.ref_model = None
        if settings.ref_model_path is None and loss.kl_coef > 0 and settings.lora:
            self.ref_model = BasePolicy(self.engine, model.policy)
        else:
            ref_path = settings.ref_model_path or (self.model_path if loss.kl_coef > 0 else None)
            if ref_path is not None:
                self.ref_model = self._reference_model(str(ref_path))
        self.passes = ForwardPasses(
            self.engine,
            self.ref_model,
            settings.micro_batch_size,
            settings.share_prompts,
            settings.length_buckets,
            self.device,
        )

    # ----------------------------------------------------------------------------- set-up

    def _load_model(self, path: str, trainable: bool = True) -> TokenLogprobs:
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
            # Non-reentrant checkpointing differentiates the adapters inside a checkpointed
            # layer without PEFT's `enable_input_require_grads` (the reentrant kind needs it).
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if trainable and s.lora:
            model = with_adapter(model, s.lora)
        model.train(trainable)
        return TokenLogprobs(model, self.temperature, s.logits_chunk_mib)

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

    # ----------------------------------------------------------------------------- step

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        inspect_groups: list[int] | None = None,
        loss_options: dict | None = None,
    ) -> dict[str, float]:
        """One learner step on this rank's shard of a rollout batch: `ppo_epochs` passes over
        its mini-batches, one optimizer step per mini-batch (by default one pass over the
        whole batch: one optimizer step).

        batch: the learner batch of docs/architecture.md (keys `BATCH_KEYS`, whole prompt
        groups of one size). Every rank must call it, each with its own shard, and every rank
        holds as many groups (so that mini-batch j is the j-th slice of every shard). Returns
        metrics that are equal on every rank (reduced over micro-batches and ranks): the
        rollout batch's statistics, the updates' means, and the last update's detail.

        The loss's batch statistics (CA-GRPO's kernel weights, the Clip-Cov/KL-Cov
        selections) are fixed once per rollout batch from the proximal (old) policy's
        log-probs (`token_stats="rollout"`), or recomputed for each mini-batch from the
        current policy (`"minibatch"`, as verl does with its current log-probs); the loss
        normalisers are always the mini-batch's, over all ranks.

        `inspect_groups`: prompt groups whose per-token values this step keeps for the token
        inspector (`take_inspection`); the rank keeps those it holds. `loss_options`: loss
        options (`LossSpec` fields) set from this step on, e.g. a controller's `cagrpo_kappa`.
        """
        start = time.perf_counter()
        s = self.settings
        if loss_options:
            self.loss = as_spec(self.loss, loss_options)
        batch = self._to_device(check_batch(batch))
        mask = batch["response_mask"]
        reducer = RankReducer(self.device)
        tokens = mask.sum()
        reducer.sum("learner/tokens", tokens)
        reducer.sum("learner/responses", mask.shape[0])

        # (1) Proximal pass: the ratio's denominator, and what the loss's statistics are taken on.
        proximal = self.passes.proximal(batch, single_update=s.ppo_epochs * s.mini_batches == 1)
        old_logprobs = proximal.logprobs
        mismatch = (old_logprobs - batch["behavior_logprobs"]).abs()[mask]
        reducer.mean("logprob/mismatch_mean", mismatch.mean() if tokens else 0.0, tokens)
        reducer.max("logprob/mismatch_max", mismatch.max() if tokens else 0.0)
        reducer.mean("entropy/mean", proximal.entropy[mask].mean() if tokens else 0.0, tokens)

        # (2) Off-policy correction: the generator's samples reweighted to the proximal policy.
        is_weights = None
        if self.loss.tis_cap is not None:
            is_weights, tis_metrics = truncated_is_weights(
                old_logprobs, batch["behavior_logprobs"], mask, self.loss.tis_cap
            )
            for name, value in tis_metrics.items():
                reducer.mean(name, value, tokens)

        # (3) Loss preparation: the group-relative advantages (computed when the groups got
        # their rewards) and the loss's batch statistics, once over the rollout batch on all
        # ranks.
        advantages = batch["advantages"]
        reducer.mean("reward/mean", batch["rewards"].mean(), mask.shape[0])
        reducer.mean("advantage/abs_mean", advantages.abs().mean(), mask.shape[0])
        horizon = self._max_response_length(mask)
        stats_seed = s.seed * 1_000_003 + self.step
        rollout_stats = prepare_loss_inputs(
            self.loss,
            old_logprobs,
            advantages,
            mask,
            batch["group_ids"],
            seed=stats_seed,
            max_response_length=horizon,
            process_group=data_parallel_group(),
        )
        for name, value in rollout_stats.metrics.items():
            reduce_batch_metric(reducer, name, value, tokens)

        # (4) PPO epochs: epochs x mini-batches, each one optimizer step over its micro-batches.
        lr = float(self.engine.optimizer.param_groups[0]["lr"])
        inputs = UpdateInputs(
            batch,
            old_logprobs,
            advantages,
            proximal.ref_logprobs,
            is_weights,
            clipped=torch.zeros_like(mask) if inspect_groups else None,
            rollout_stats=rollout_stats,
            horizon=horizon,
            stats_seed=stats_seed,
            fused=proximal.fused,
        )
        updates = ppo_epochs(self.engine, self.passes, self.loss, s, inputs, self.world_size)
        self.step += 1
        metrics = reducer.reduce()
        metrics.update(combine_updates(updates))

        # (5) Inspection: the inspected groups' tokens, and the step's own KL where asked.
        if inspect_groups:
            shown = token_fields(self.loss, rollout_stats, mask)
            self.inspection = token_records(
                inputs, inspect_groups, proximal.entropy, rollout_stats, shown
            )
        if s.measure_policy_change:
            metrics.update(policy_change(self.passes, batch, old_logprobs))
        metrics.update(
            {
                "lr": lr,
                "learner/step": float(self.step),
                "learner/updates": float(len(updates)),
                "time/train_step_s": time.perf_counter() - start,
            }
        )
        return metrics

    def take_inspection(self) -> dict[str, np.ndarray]:
        """The per-token values the last step kept for the token inspector (and forget them):
        this rank's rows of the inspected groups, [r, T] arrays aligned with the batch."""
        records, self.inspection = self.inspection, {}
        return records

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

    # ----------------------------------------------------------------------------- weights

    def iter_sync_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF parameter name, full tensor) on rank 0, for the weight broadcast; under
        LoRA only the adapter's, named and laid out as PEFT saves them (`policies/lora.py`),
        float32.

        Every rank must iterate to the end: under ZeRO-3 each parameter is gathered from all
        ranks in turn. Other ranks yield nothing. Tied weights appear once (under the name of
        the embedding), as `load_weights` of vLLM and `load_state_dict(strict=False)` expect.
        The tensors are copies under ZeRO-3 (the gathered storage is freed after each one) and
        the live parameters otherwise, so a consumer that keeps them must copy them.
        """
        named = self.adapter or self.engine.module.policy.named_parameters()
        for name, param in named:
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
        sent: list[tuple[str, torch.Tensor]] = []  # the adapter's, for its checksum
        if self.adapter is not None:
            tensors = _recorded(tensors, sent)
        try:
            stats = asdict(self.weight_sender.send(tensors, version))
        except WeightSyncError as exc:
            for _ in tensors:  # keep every rank's ZeRO-3 gathers matched
                pass
            return {"error": str(exc)}
        if self.adapter is not None:
            stats["adapter_checksum"] = adapter_checksum(sent)
        return stats

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """All of `iter_sync_weights` as one CPU dict on rank 0 (empty on other ranks)."""
        return {name: t.to("cpu", copy=True) for name, t in self.iter_sync_weights()}

    def save_hf(self, out_dir: str | Path) -> Path:
        """Write the current policy in the Hugging Face layout (config, safetensors, tokenizer,
        generation config), loadable by transformers and vLLM; under LoRA the adapter merged
        into the base in float32, then cast to the model's dtype (no PEFT modules). Every
        rank must call it; rank 0 writes."""
        out = Path(out_dir)
        state = self.state_dict_for_sync()
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if self.adapter is not None:
                dtype = getattr(torch, self.settings.dtype)
                policy = merged_policy(self.model_path, dtype, self.settings.lora, state)
                policy.save_pretrained(out, safe_serialization=True)
            else:
                self.engine.module.policy.save_pretrained(
                    out, state_dict=state, safe_serialization=True
                )
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(out)
        self._barrier()
        return out

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write the LoRA adapter in PEFT's format (`adapter_config.json`,
        `adapter_model.safetensors`), which `PeftModel.from_pretrained(base, out_dir)` loads.
        Every rank must call it; rank 0 writes."""
        if self.adapter is None:
            raise RuntimeError("save_adapter needs a LoRA adapter (model.lora.rank > 0)")
        out = Path(out_dir)
        state = self.state_dict_for_sync()
        if self.rank == 0:
            save_adapter(out, self.settings.lora, self.model_path, state)
        self._barrier()
        return out

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, ckpt_dir: str | Path, client_state: dict | None = None) -> None:
        """Save model, optimizer and lr-scheduler state (DeepSpeed layout), the step, the
        caller's `client_state`, and this rank's RNG states; under LoRA the adapter and its
        optimizer state only (the frozen base is the policy at model_path), except that with
        tied embeddings DeepSpeed 0.19.8 keeps the head under its second name (it drops frozen
        parameters by `named_parameters()`, which lists a tied weight once). Every rank must
        call it."""
        ckpt = Path(ckpt_dir)
        ckpt.mkdir(parents=True, exist_ok=True)
        state = {"learner_step": self.step, "client_state": dict(client_state or {})}
        self.engine.save_checkpoint(
            str(ckpt),
            tag=_CHECKPOINT_TAG,
            client_state=state,
            exclude_frozen_parameters=self.adapter is not None,
        )
        torch.save(rng_state(), ckpt / f"rng_rank{self.rank}.pt")
        self._barrier()

    def load_checkpoint(self, ckpt_dir: str | Path) -> dict:
        """Restore what `save_checkpoint` wrote (same world size and ZeRO stage); returns the
        caller's `client_state`. Every rank must call it."""
        ckpt = Path(ckpt_dir)
        if not (ckpt / _CHECKPOINT_TAG).is_dir():
            raise FileNotFoundError(f"no learner checkpoint in {ckpt} (missing {_CHECKPOINT_TAG}/)")
        # Under LoRA the checkpoint lacks the frozen base, which the model already holds.
        path, state = self.engine.load_checkpoint(
            str(ckpt), tag=_CHECKPOINT_TAG, load_module_strict=self.adapter is None
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the learner checkpoint in {ckpt}")
        self.step = int(state["learner_step"])
        set_rng_state(torch.load(ckpt / f"rng_rank{self.rank}.pt", weights_only=False))
        return state["client_state"]

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()


def _recorded(
    named_tensors: Iterator[tuple[str, torch.Tensor]], into: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors`, each pair also appended to `into` as it passes (what a sync sent)."""
    for pair in named_tensors:
        into.append(pair)
        yield pair
