"""torch.distributed and DeepSpeed set-up for one data-parallel learner rank.

A learner rank joins its data-parallel group through the environment variables that
torch.distributed's `env://` rendezvous reads (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
with gloo on the CPU and NCCL on GPUs.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from cagrpo_ray.learner.sizes import REDUCE_BUCKET_ELEMENTS

log = logging.getLogger("cagrpo_ray")

# Large enough that DeepSpeed never prints its own progress lines between our metrics.
_NEVER = 1 << 62


def default_backend() -> str:
    """`nccl` where CUDA is usable, `gloo` otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_data_parallel(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 600.0,
) -> None:
    """Join (or reuse) the default process group of `world_size` learner ranks.

    A process that already belongs to a group of the same size reuses it, so that several
    learners can be built one after another in one process (world size 1, in tests).
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"this process already is rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"cannot become rank {rank} of {world_size}"
            )
        return
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    backend = default_backend()
    if backend == "gloo":  # DeepSpeed builds its CPU comm extension on first use
        use_environment_ninja()
        clear_stale_build_lock(comm_extension_dir())
    # The group's store listens on MASTER_ADDR only (env://'s would listen on every
    # interface); DeepSpeed then takes the group as it is.
    log.info("process group: rank %d of %d, store at %s:%d", rank, world_size, master_addr,
             master_port)  # fmt: skip
    dist.init_process_group(
        backend,
        store=rendezvous_store(rank, world_size, master_addr, master_port, timeout_s),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        verbose=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        rank=rank,
        world_size=world_size,
    )


def rendezvous_store(
    rank: int, world_size: int, host: str, port: int, timeout_s: float
) -> dist.TCPStore:
    """The learner group's `TCPStore`: rank 0's listens on `host:port` only, the others dial
    it (waiting up to `timeout_s` for it to open)."""
    from cagrpo_ray.sync.group import listening_store

    if rank == 0:
        return listening_store(host, port, world_size, timeout_s)
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


COMM_EXTENSION = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME
STALE_LOCK_S = 60.0


def comm_extension_dir() -> Path:
    """Where torch builds (and caches) DeepSpeed's CPU comm extension."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(COMM_EXTENSION, verbose=False))


def use_environment_ninja() -> str | None:
    """Put this interpreter's environment's `ninja` first on PATH; returns its path, or None
    when the environment has none (then PATH is left as it is).

    torch builds an extension with the first `ninja` on PATH, and ninja records a hash of each
    build command in the build folder's `.ninja_log`; ninja 1.11 (Debian's) and 1.13 (the pip
    wheel in the virtual environment) hash differently, so a learner started with the
    environment's `bin` on PATH (a Ray job, an activated venv) and one started without it
    each found the other's build out of date and rebuilt the extension (60-110 s on 2 cores).
    """
    ninja = Path(sys.executable).parent / "ninja"
    if not ninja.is_file():
        return None
    if shutil.which("ninja") != str(ninja):
        path = os.environ.get("PATH")
        os.environ["PATH"] = os.pathsep.join(filter(None, [str(ninja.parent), path]))
    return str(ninja)


def clear_stale_build_lock(build_dir: Path, older_than_s: float = STALE_LOCK_S) -> bool:
    """Remove a torch extension build lock that no build holds; True if one was removed.

    torch's `FileBaton` lock is a bare file with no owner: a process killed while it builds
    (a SIGKILLed learner, a test's teardown) leaves it, and every later learner then waits for
    it forever, silently. A build runs `ninja` (and its compilers) in the build folder, so a
    lock older than `older_than_s` with no process working there is stale. A younger lock is
    left alone: another rank may have just taken it and be about to start its build.
    """
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < older_than_s or _building_in(build_dir):
        log.info("waiting for the build of %s (lock %s, %.0f s old)", build_dir.name, lock, age)
        return False
    lock.unlink(missing_ok=True)
    log.warning("removed a stale build lock %s (%.0f s old, no build running there)", lock, age)
    return True


def _building_in(build_dir: Path) -> bool:
    import psutil  # a Ray and vLLM dependency

    target = str(build_dir.resolve())
    for process in psutil.process_iter():
        try:
            if process.cwd() == target:
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return False


def deepspeed_config(
    zero_stage: int,
    micro_batch_size: int,
    world_size: int,
    grad_clip: float,
    bf16: bool = False,
) -> dict:
    """DeepSpeed config for one optimizer step per `train_step`.

    Gradient accumulation is driven by the learner (it marks the accumulation boundary itself,
    since the number of micro-batches depends on each batch), so DeepSpeed's own
    `gradient_accumulation_steps` stays 1 and never rescales the loss.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {zero_stage!r}")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "gradient_clipping": grad_clip,
        # DeepSpeed's default bucket sizes, stated so that the memory planner uses the same:
        # ZeRO-1/2 allocate a reduce bucket of this many gradient elements in every backward.
        "zero_optimization": {
            "stage": zero_stage,
            "reduce_bucket_size": REDUCE_BUCKET_ELEMENTS,
            "allgather_bucket_size": REDUCE_BUCKET_ELEMENTS,
        },
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
    }
    if bf16:
        # Without this DeepSpeed sums the micro-batches' gradients in bf16 (its default is the
        # model dtype): ~24 micro-batches in the GPU recipes would lose most of their bits.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def data_parallel_group():
    """The default process group when there are several ranks, else None (no communication)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the learner ranks (a no-op when there is one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=reduce_op[op])
    return tensor


class RankReducer:
    """Scalars combined over micro-batches and then over ranks, in three all-reduces at the end
    of a step (sums, maxima, minima) instead of one per value.

    `mean(name, value, weight)` gives sum(value * weight) / sum(weight), e.g. token-weighted.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._min: dict[str, torch.Tensor] = {}
        self._means: set[str] = set()

    def _scalar(self, value) -> torch.Tensor:
        return torch.as_tensor(value, device=self.device).detach().to(torch.float64)

    def sum(self, name: str, value) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + self._scalar(value)

    def mean(self, name: str, value, weight) -> None:
        self._means.add(name)
        weight = self._scalar(weight)
        self.sum(name, self._scalar(value) * weight)
        self.sum(f"{name}\0weight", weight)

    def max(self, name: str, value) -> None:
        value = self._scalar(value)
        self._max[name] = torch.maximum(self._max.get(name, value), value)

    def min(self, name: str, value) -> None:
        value = self._scalar(value)
        self._min[name] = torch.minimum(self._min.get(name, value), value)

    def reduce(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for table, op in ((self._sums, "sum"), (self._max, "max"), (self._min, "min")):
            if table:
                # Sorted: every rank must send the same names in the same order.
                names = sorted(table)
                values = all_reduce_(torch.stack([table[n] for n in names]), op).tolist()
                out.update(zip(names, values, strict=True))
        for name in self._means:
            weight = out.pop(f"{name}\0weight")
            out[name] = out[name] / weight if weight > 0 else 0.0
        return out


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators of this process."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every random generator's state in this process (for a rank's checkpoint)."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
