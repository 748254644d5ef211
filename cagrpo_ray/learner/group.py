"""LearnerGroup: m data-parallel `Learner` ranks as Ray actors, driven as one learner.

The group cuts each learner batch into one shard per rank, keeping prompt groups whole (the
advantages and CA-GRPO's group-scope weights are computed inside a group), runs the ranks'
steps in parallel and returns rank 0's metrics (every rank reports the same, all-reduced,
numbers). The ranks form one torch.distributed group: if one actor dies, the others would wait
in a collective forever, so the group kills them and raises `LearnerGroupError` (its `lost`
says whether a rank's process died, so that the trainer may rebuild the group from its latest
checkpoint, `learner/restarts.py`; else a rank raised, and the run stops).
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from cagrpo_ray.algo import LossSpec
from cagrpo_ray.console import LOG_FILE_ENV, actor_env, redirect_output
from cagrpo_ray.learner.batch import check_batch, group_sizes
from cagrpo_ray.learner.settings import LearnerSettings
from cagrpo_ray.sync.group import sync_host

if TYPE_CHECKING:
    from cagrpo_ray.learner.learner import Learner


# How long a failed call waits for the other ranks' outcomes to learn whether a rank's process
# died: a survivor's collective fails at once when its peer's sockets close, while Ray reports
# the dead actor within a second or two; a rank that raised leaves its partners hanging in a
# collective, so this is also what a plain error waits before the group is stopped.
DEATH_REPORT_S = 10.0


class LearnerGroupError(RuntimeError):
    """A learner rank died or failed; the data-parallel group cannot continue (its ranks are
    stopped). `rank`: the rank whose process died, else the rank that raised; `lost`: a
    process died (the group can be rebuilt), rather than a rank raising an error."""

    def __init__(self, message: str, rank: int | None = None, lost: bool = False):
        super().__init__(message)
        self.rank, self.lost = rank, lost


class LearnerActor:
    """Thin Ray shell around one `Learner` rank.

    Construction is split in two so that rank 0's node address and a free port are known
    before any rank joins the process group (joining blocks until all ranks arrive). DeepSpeed
    is imported in `setup`, once this rank's output goes to its log file (if it has one).
    """

    def __init__(self) -> None:
        redirect_output()
        self.learner: Learner | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """The address the group's store will listen on (this node's IP, or loopback when the
        cluster is this one node, as the weight sync's) and a port free there, for MASTER_ADDR
        / MASTER_PORT."""
        host = sync_host(ray.util.get_node_ip_address(), single_node())
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, 0), family=family) as s:
            port = s.getsockname()[1]
        return host, port

    def setup(self, settings: LearnerSettings, loss: LossSpec, **rank: Any) -> None:
        """Build this rank's Learner; it joins the process group from rank, world_size,
        master_addr and master_port (exported as RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        from cagrpo_ray.learner.learner import Learner

        self.learner = Learner(settings, loss, **rank)

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        inspect_groups: list[int] | None = None,
        loss_options: dict | None = None,
    ) -> dict[str, float]:
        return self.learner.train_step(batch, inspect_groups, loss_options)

    def take_inspection(self) -> dict:
        return self.learner.take_inspection()

    def save_checkpoint(self, ckpt_dir: str, client_state: dict) -> None:
        self.learner.save_checkpoint(ckpt_dir, client_state)

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self.learner.load_checkpoint(ckpt_dir)

    def save_hf(self, out_dir: str) -> str:
        return str(self.learner.save_hf(out_dir))

    def save_adapter(self, out_dir: str) -> str:
        return str(self.learner.save_adapter(out_dir))

    def open_weight_sender(
        self, world_size: int, backend: str, timeout_s: float, bucket_mb: float
    ) -> dict | None:
        host = sync_host(ray.util.get_node_ip_address(), single_node())
        return self.learner.open_weight_sender(host, world_size, backend, timeout_s, bucket_mb)

    def send_weights(self, version: int) -> dict:
        return self.learner.send_weights(version)

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(learner, *args)` in this actor (e.g. the weight-sync sender on rank 0)."""
        return fn(self.learner, *args)


def single_node() -> bool:
    """Whether the Ray cluster is one alive node."""
    return sum(1 for node in ray.nodes() if node["Alive"]) == 1


SHARD_BY = ("tokens", "count")


def split_by_groups(
    batch: dict[str, torch.Tensor], num_shards: int, by: str = "tokens"
) -> list[dict[str, torch.Tensor]]:
    """Cut a learner batch into `num_shards` shards of whole prompt groups.

    Each shard gets as many groups as an even split by count gives it (counts differ by at most
    one). `by="count"`: consecutive groups, shard after shard. `by="tokens"`: the groups go,
    the most tokens first, each to the shard with the fewest tokens so far that has room, so
    the shards' token counts differ by at most one group's. A rank's step takes time in
    proportion to its tokens and the ranks meet at every collective: split by count, one rank
    sat idle for seconds while the other finished (`benchmarks/bench_learner_split.py`).
    A shard keeps its groups in batch order.
    Raises if there are fewer groups than shards: a rank with no rows cannot take a step.
    """
    if by not in SHARD_BY:
        raise ValueError(f"by={by!r}; choose one of {SHARD_BY}")
    sizes = group_sizes(batch["group_ids"]).tolist()
    if len(sizes) < num_shards:
        raise ValueError(
            f"the batch has {len(sizes)} prompt groups, fewer than the {num_shards} learner "
            f"ranks; send at least {num_shards} groups per step"
        )
    ends = np.cumsum([0, *sizes])
    chunks = np.array_split(np.arange(len(sizes)), num_shards)  # the even split by count
    if by == "count":
        return [
            {k: v[int(ends[chunk[0]]) : int(ends[chunk[-1] + 1])] for k, v in batch.items()}
            for chunk in chunks
        ]
    row_tokens = batch["attention_mask"].sum(1).tolist()
    tokens = [sum(row_tokens[ends[g] : ends[g + 1]]) for g in range(len(sizes))]
    room = [len(chunk) for chunk in chunks]
    members: list[list[int]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for g in sorted(range(len(sizes)), key=lambda g: (-tokens[g], g)):
        shard = min(
            (s for s in range(num_shards) if len(members[s]) < room[s]),
            key=lambda s: (load[s], s),
        )
        members[shard].append(g)
        load[shard] += tokens[g]
    shards = []
    for groups in members:
        rows = torch.cat([torch.arange(int(ends[g]), int(ends[g + 1])) for g in sorted(groups)])
        shards.append({k: v[rows] for k, v in batch.items()})
    return shards


class LearnerGroup:
    """`num_learners` data-parallel `Learner` ranks on Ray, used like one learner.

    Every rank gets the same `settings` (its torch thread count set from the Ray CPUs it asks
    for) and loss `spec`; the group sets each rank's place in the process group. With
    `log_dir`, rank r writes its output (DeepSpeed's included) to `log_dir/learner-<r>.log`.
    """

    def __init__(
        self,
        num_learners: int,
        settings: LearnerSettings,
        loss: LossSpec,
        num_cpus_per_learner: float = 0.5,
        num_gpus_per_learner: float = 0.0,
        actor_options: list[dict] | None = None,
        log_dir: str | Path | None = None,
        shard_by: str = "tokens",
    ) -> None:
        if num_learners < 1:
            raise ValueError(f"num_learners must be >= 1, got {num_learners}")
        # Per rank: Ray options (resources and a placement-group bundle, `placement.py`).
        options = (
            actor_options
            or [dict(num_cpus=num_cpus_per_learner, num_gpus=num_gpus_per_learner)] * num_learners
        )
        threads = max(1, int(options[0]["num_cpus"]))
        remote_cls = ray.remote(max_restarts=0)(LearnerActor)
        envs = [{"OMP_NUM_THREADS": str(threads)} for _ in range(num_learners)]
        self.log_files: list[Path | None] = [None] * num_learners  # each rank's output
        if log_dir is not None:
            for rank, env in enumerate(envs):
                env.update(actor_env(log_dir, f"learner-{rank}"))
                self.log_files[rank] = Path(env[LOG_FILE_ENV])
        self.actors = [
            remote_cls.options(**options[rank], runtime_env={"env_vars": envs[rank]}).remote()
            for rank in range(num_learners)
        ]
        self.shard_by = shard_by  # `split_by_groups`'s `by`
        self._batch_groups: list[int] = []  # the last batch's group ids, in its order
        master_addr, master_port = ray.get(self.actors[0].rendezvous_address.remote())
        settings = dataclasses.replace(settings, num_threads=threads)
        self._call_all(
            "setup",
            args_per_rank=[(settings, loss)] * num_learners,
            per_rank=[
                dict(
                    rank=rank,
                    world_size=num_learners,
                    master_addr=master_addr,
                    master_port=master_port,
                )
                for rank in range(num_learners)
            ],
        )

    @property
    def num_learners(self) -> int:
        return len(self.actors)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of every rank on its shard of `batch`; returns rank 0's metrics.

        A batch that breaks the contract raises ValueError here, before any rank starts."""
        shards = self._shards(batch)
        return self._call_all("train_step", args_per_rank=[(ray.put(s),) for s in shards])[0]

    def _shards(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """One shard per rank (`split_by_groups`); the batch's group order, for `inspection`."""
        shards = split_by_groups(check_batch(batch), self.num_learners, self.shard_by)
        self._batch_groups = torch.unique_consecutive(batch["group_ids"]).tolist()
        return shards

    def foreach_learner(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(learner, *args)` on every rank concurrently; the results in rank order (as
        RLlib's `LearnerGroup.foreach_learner`: to look inside the ranks, e.g. their whole
        parameters under ZeRO-3, or the weights a sync sends)."""
        return self._call_all("apply", args_per_rank=[(fn, *args)] * self.num_learners)

    def save_checkpoint(self, ckpt_dir: str, client_state: dict | None = None) -> None:
        self._call_all(
            "save_checkpoint",
            args_per_rank=[(str(ckpt_dir), client_state or {})] * self.num_learners,
        )

    def load_checkpoint(self, ckpt_dir: str) -> dict:
        return self._call_all(
            "load_checkpoint", args_per_rank=[(str(ckpt_dir),)] * self.num_learners
        )[0]

    def save_hf(self, out_dir: str) -> str:
        return self._call_all("save_hf", args_per_rank=[(str(out_dir),)] * self.num_learners)[0]

    def save_adapter(self, out_dir: str) -> str:
        """The LoRA adapter in PEFT's format (`Learner.save_adapter`)."""
        args = [(str(out_dir),)] * self.num_learners
        return self._call_all("save_adapter", args_per_rank=args)[0]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def submit_train_step(
        self,
        batch: dict[str, torch.Tensor],
        inspect_groups: list[int] | None = None,
        loss_options: dict | None = None,
    ) -> list:
        """`train_step` without waiting: the ranks' object refs, for `collect(refs)`.
        `inspect_groups`: groups whose per-token values the step keeps (`inspection`);
        `loss_options`: loss options set from this step on (e.g. a controller's kappa)."""
        args = [(ray.put(s), inspect_groups, loss_options) for s in self._shards(batch)]
        return self._submit("train_step", args_per_rank=args)

    def inspection(self) -> dict:
        """The last step's kept per-token values of every rank, rows in the batch's order
        (each [rows, T] array aligned with the batch's columns)."""
        parts = [p for p in self._call_all("take_inspection") if p]
        if not parts:
            return {}
        kept = {
            key: None if parts[0][key] is None else np.concatenate([p[key] for p in parts])
            for key in parts[0]
        }
        # Split by tokens, the shards hold interleaved sets of groups (`split_by_groups`):
        # back to the order of the groups in the batch (stable: each group's rows keep theirs).
        position = {g: i for i, g in enumerate(self._batch_groups)}
        order = np.argsort([position[int(g)] for g in kept["group_ids"]], kind="stable")
        return {key: None if value is None else value[order] for key, value in kept.items()}

    def open_weight_sender(
        self, world_size: int, backend: str, timeout_s: float, bucket_mb: float
    ) -> dict:
        """Rank 0 (re)opens its end of the weight-sync group; returns the group's address."""
        args = (world_size, backend, timeout_s, bucket_mb)
        return self._call_all("open_weight_sender", args_per_rank=[args] * self.num_learners)[0]

    def submit_send_weights(self, version: int) -> list:
        """Every rank's `send_weights(version)` without waiting (ZeRO-3 gathers need all of
        them): the refs, for `collect(refs)`; rank 0's result is the sync's."""
        return self._submit("send_weights", args_per_rank=[(version,)] * self.num_learners)

    def _call_all(
        self,
        method: str,
        args_per_rank: list[tuple] | None = None,
        per_rank: list[dict] | None = None,
    ) -> list[Any]:
        """Call `method` on every rank at once and wait for all; fail fast on the first failure."""
        return self.collect(self._submit(method, args_per_rank, per_rank), method)

    def _submit(
        self,
        method: str,
        args_per_rank: list[tuple] | None = None,
        per_rank: list[dict] | None = None,
    ) -> list:
        if not self.actors:
            raise LearnerGroupError("the learner group was shut down")
        refs = []
        for rank, actor in enumerate(self.actors):
            args = args_per_rank[rank] if args_per_rank else ()
            kwargs = per_rank[rank] if per_rank else {}
            refs.append(getattr(actor, method).remote(*args, **kwargs))
        return refs

    def collect(self, refs: list, method: str = "a call") -> list[Any]:
        """The ranks' results in rank order, failing fast on the first failure.

        Waiting on the ranks one by one would hang on a dead rank's partners, which block in a
        collective; so the group waits for whichever finishes first and, on a failure, kills
        the rest before raising `LearnerGroupError`.
        """
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[done[0]]] = ray.get(done[0])
            except (RayActorError, RayTaskError) as err:
                self._fail(method, rank_of[done[0]], err, pending, rank_of)
        return [results[rank] for rank in range(len(refs))]

    def _fail(
        self, method: str, rank: int, err: Exception, pending: list, rank_of: dict
    ) -> NoReturn:
        """Stop every rank and raise `LearnerGroupError` for `rank`'s failure `err`.

        The first failure seen is often not the cause: when a rank's process is killed, its
        partners' collectives fail at once ("Connection closed by peer"), before Ray reports
        the dead actor. So the other ranks' outcomes are awaited for up to `DEATH_REPORT_S`,
        and a rank whose actor died is the one named."""
        dead = rank if isinstance(err, RayActorError) else None
        deadline = time.monotonic() + DEATH_REPORT_S
        while dead is None and pending and (left := deadline - time.monotonic()) > 0:
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as other:
                    dead, err = rank_of[ref], other
                except RayTaskError:
                    pass
        named = rank if dead is None else dead
        log_file = self.log_files[named]
        world = len(rank_of)
        self.shutdown()
        raise LearnerGroupError(
            f"learner rank {named} {'failed' if dead is None else 'died'} during {method}(); "
            f"the data-parallel group cannot continue without it, so all {world} ranks were "
            "stopped. " + (f"Its output: {log_file}. " if log_file else "") + f"Cause: {err}",
            rank=named,
            lost=dead is not None,
        ) from err
