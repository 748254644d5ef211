"""How the bytes of a weight sync move: in-place broadcasts from one root rank, and a way out.

`join_group` (`group.py`) returns one of these once every rank has come to the rendezvous:

- `GlooTransport` (CPU tensors): a standalone `ProcessGroupGloo`.
- `PyNcclTransport` (CUDA tensors): vLLM's `PyNcclCommunicator`, ctypes calls into libnccl,
  over vLLM's `StatelessProcessGroup` on the group's own store.

Both offer `start_broadcast(tensor, root, timeout_s)`, which returns a work whose
`wait(timedelta)` raises `RuntimeError` (or `DistError`) if this rank's part is not done in
time; `abort()`, after a failed wait, so that no rank stays blocked (the transport is unusable
afterwards); and `close()`.

Why not `ProcessGroupNCCL` on GPUs: its watchdog thread, not the caller's wait, is the first to
see a peer that died mid-broadcast (as an asynchronous NCCL error), and under
TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3 (torch's default) it then ends the whole process,
learner rank 0 and DeepSpeed's group with it. Torch reads that mode from the environment in
every `ProcessGroupNCCL` constructor, and its `Options` have no field for it, so the sync
group could get 0 or 2 only by editing the process environment around its construction; even
then the watchdog's own abort (under 2) races ours, and its heartbeat monitor may still end
the process (pytorch#155916). PyNccl has no watchdog: the broadcast runs on this transport's
own CUDA stream, `wait` polls a CUDA event until its timeout, and `abort` is `ncclCommAbort`,
which needs no peer. vLLM's own weight transfer, TRL and OpenRLHF build their weight-sync
groups this way.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

POLL_S = 1e-4  # between two looks at an NCCL broadcast's completion event


class GlooTransport:
    """A `ProcessGroupGloo` of `world_size` ranks over `store`; gloo honours each operation's
    timeout itself."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, host: str):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        options._devices = [_gloo_device(host)]
        self.group = dist.ProcessGroupGloo(store, rank, world_size, options)

    def start_broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float):
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        options.timeout = timedelta(seconds=timeout_s)
        return self.group.broadcast([tensor], options)

    def abort(self) -> None:
        """Gloo's abort returns without unblocking, which is harmless here: gloo's own timeout
        has already ended the wait."""
        stop = getattr(self.group, "abort", None)
        if stop is None:
            return
        try:
            stop()
        except (RuntimeError, dist.DistError):
            pass  # already broken; nothing more to release

    def close(self) -> None:
        self.group = None


class PyNcclTransport:
    """vLLM's `PyNcclCommunicator` of `world_size` ranks on the CUDA `device`, formed through
    `store`. vLLM is imported here and nowhere else in this package, so CPU runs never load it.

    Construction blocks until every rank has called it: NCCL's `ncclCommInitRank` and a
    warm-up all-reduce have no timeout of their own (`group.form_transport` bounds it).
    """

    def __init__(self, store, rank: int, world_size: int, device: torch.device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # The NCCL unique id travels through the store that the rendezvous already uses,
        # rather than the second TCPStore that `StatelessProcessGroup.create` would open.
        metadata = StatelessProcessGroup(rank=rank, world_size=world_size, store=store)
        # The constructor's warm-up all-reduce runs on vLLM's current stream, which
        # `torch.cuda.stream` sets: ours, not the one the learner trains on. A communicator
        # shared with another process is made without the NCCL variables vLLM pins for its
        # own (as vLLM's weight transfer makes it).
        with torch.cuda.device(device), torch.cuda.stream(self.stream), unpinned_nccl_env():
            self.comm = PyNcclCommunicator(metadata, device=device)
        if self.comm.disabled:
            raise RuntimeError(
                "vLLM's PyNcclCommunicator came up disabled (libnccl did not load, or "
                "VLLM_DISABLE_PYNCCL is set): the NCCL weight sync needs it; unset "
                "VLLM_DISABLE_PYNCCL, or use the 'gloo' backend"
            )

    def start_broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> NcclWork:
        """Queue the broadcast on this transport's stream. NCCL has no per-operation timeout:
        `timeout_s` is unused, the work's `wait` carries one."""
        if self.comm.disabled:  # a disabled communicator's broadcast returns without moving data
            raise RuntimeError("the NCCL communicator was aborted; build a new group")
        with torch.cuda.device(self.device):
            # After what the caller's stream has queued: packing the bucket (learner), or the
            # loader's last reads of a reused buffer (generator).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                self.comm.broadcast(tensor, src=root, stream=self.stream)
            except RuntimeError:
                # NCCL would not queue it (its communicator may already hold a lost peer's
                # error): abort now, so that the broadcast still in flight lets go of the GPU.
                self.abort()
                raise
            # Its memory is not reused before the stream is past it, even when a failed wait
            # drops the last reference while the kernel still runs.
            tensor.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return NcclWork(done, tensor)

    def abort(self) -> None:
        """`ncclCommAbort`, through vLLM's `destroy` (in a thread of its own, at most 5 s):
        frees the communicator without its peers and ends its kernels."""
        self.comm.destroy()

    def close(self) -> None:
        # Abort, not the collective ncclCommDestroy: a peer may already be gone.
        self.abort()


class NcclWork:
    """A broadcast queued on a `PyNcclTransport`'s stream; `wait` polls its completion event,
    so the caller, not a watchdog, decides what a late peer costs."""

    def __init__(self, done, tensor: torch.Tensor):
        self._done = done  # a CUDA event recorded after the broadcast
        self._tensor = tensor  # kept alive until the broadcast is done

    def wait(self, timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self._done.query():
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the NCCL broadcast was not done after {timeout.total_seconds():g} s"
                )
            time.sleep(POLL_S)
        self._tensor = None


def _gloo_device(host: str):
    # A loopback store means every rank is on this machine: talk over loopback. Otherwise gloo's
    # default device (hostname lookup, or the interface named by GLOO_SOCKET_IFNAME).
    if _is_loopback(host):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
