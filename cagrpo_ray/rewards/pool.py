"""A small pool of persistent verifier processes with a hard per-call deadline.

Each worker is a long-lived Python process (`python -c "...serve_verifier_worker()"`) that has
imported the verifiers once and then reads one job at a time from its pipe, scores it and
writes the score back. The caller gives each job `timeout_s` of wall-clock time from the moment
it is handed over; a worker that overruns is SIGKILLed and replaced, and its job scores 0 with
an error string. Nothing here uses `signal.alarm`, so the pool works off the main thread, e.g.
inside a Ray actor.

Workers are started with `subprocess`, not `multiprocessing`: a multiprocessing child re-runs
the parent's `__main__` script, which fails for `python -` and repeats an unguarded training
script's top-level code. A replacement worker takes up to about a second to import what its
verifiers need (reasoning_gym, math-verify); jobs go only to workers that have said they are
ready, so the start-up is not charged to a job.
"""

from __future__ import annotations

import importlib
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from cagrpo_ray.rewards.verifiers import Verifier

READY = "ready"
HEAVY_IMPORTS = {  # verifier name -> modules its first call would otherwise import
    "reasoning_gym": ("reasoning_gym",),
    "reasoning_gym_text": ("reasoning_gym",),
    "math": ("math_verify", "sympy"),
    "task": ("reasoning_gym", "math_verify", "sympy"),
}
MAX_START_FAILURES = 3
PARENT_POLL_S = 1.0

# (verifier name, response, item as a dict); for a batched reward function (TRL's), the
# responses and the items of the batch as lists
Job = tuple[str, str | list[str], dict | list[dict]]
# (score, error or None); a reward function of one's own adds its components, and a batched
# one answers a list of those (one per response) unless the whole call failed
Score = tuple[float, str | None]


@dataclass
class _Worker:
    process: subprocess.Popen
    inbox: Connection  # results from the worker; EOF when it dies
    outbox: Connection  # jobs to the worker
    ready: bool = False
    job: int | None = None  # index of the job in flight
    deadline: float = 0.0


def serve_verifier_worker(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """Entry point of a worker process: setup message, then one job at a time until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller decides when workers stop
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    verifiers, memory_bytes = pickle.loads(conn_in.recv_bytes())
    if memory_bytes > 0:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        soft = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    for name, verifier in verifiers.items():  # imported now: the first job is not charged
        for module in HEAVY_IMPORTS.get(name, ()):
            importlib.import_module(module)
        if hasattr(verifier, "score_job"):  # a reward function of one's own
            try:
                verifier.function()
            except Exception:  # checked by the caller before; if not, each job reports it
                pass
    conn_out.send(READY)
    while True:
        try:
            job = conn_in.recv()
        except (EOFError, OSError):
            return
        name, response, item = job
        try:
            if hasattr(verifiers[name], "score_job"):  # scores its own errors, per sample
                conn_out.send(verifiers[name].score_job(response, item))
                continue
            score = float(verifiers[name](response, item))
            conn_out.send((score, None) if score == score else (0.0, f"{name} returned NaN"))
        except Exception as error:  # a verifier's crash is a zero score, not a dead worker
            conn_out.send((0.0, f"{name} raised {type(error).__name__}: {str(error)[:300]}"))


def _exit_with_parent(parent_pid: int) -> None:
    """A worker stuck in a verifier must not outlive the process that started it."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


class VerifierPool:
    """`num_workers` verifier processes; `map(jobs)` scores every job within its deadline.

    Args:
        verifiers: name -> `(response, item) -> float`, picklable by reference (module-level
            functions of an importable module, or `functools.partial` of them), or a
            `UserRewardFunction` (`rewards/custom.py`), whose `score_job` the worker calls.
        num_workers: worker processes; on a 2-core machine 1 or 2.
        timeout_s: wall-clock budget of one job, from hand-over to the result.
        worker_memory_bytes: address-space limit of each worker (0: none), so that a verifier
            blowing up on a pathological input cannot take the caller's memory.
    """

    def __init__(
        self,
        verifiers: Mapping[str, Verifier],
        num_workers: int = 2,
        timeout_s: float = 5.0,
        worker_memory_bytes: int = 4 << 30,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.verifiers = dict(verifiers)
        self.timeout_s = timeout_s
        self.restarts = 0  # workers killed for overrunning or found dead, over the pool's life
        self._setup = pickle.dumps((self.verifiers, worker_memory_bytes))
        self._lock = threading.Lock()
        self._start_failures = 0
        self._workers: list[_Worker] = [self._start_worker() for _ in range(num_workers)]
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def map(self, jobs: Sequence[Job]) -> list[Score]:
        """(score, error) for each job, in order. Thread-safe; calls are served one at a time."""
        unknown = {name for name, _, _ in jobs} - set(self.verifiers)
        if unknown:
            raise ValueError(
                f"unknown verifiers {sorted(unknown)}; known: {sorted(self.verifiers)}"
            )
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("the verifier pool is closed")
            return self._map(jobs)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until every worker has started (imports done), e.g. before timing a step."""
        with self._lock:
            deadline = time.monotonic() + timeout_s
            while not all(worker.ready for worker in self._workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"verifier workers not ready after {timeout_s:g} s")
                starting = [worker for worker in self._workers if not worker.ready]
                signalled = set(wait([worker.inbox for worker in starting], PARENT_POLL_S))
                for worker in starting:
                    if worker.inbox in signalled:
                        self._receive(self._workers.index(worker), [], [])

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        with self._lock:
            self._finalizer()

    def _map(self, jobs: Sequence[Job]) -> list[Score]:
        results: list[Score | None] = [None] * len(jobs)
        pending = deque(range(len(jobs)))
        while pending or any(worker.job is not None for worker in self._workers):
            for slot, worker in enumerate(self._workers):
                if worker.ready and worker.job is None and pending:
                    self._hand_over(slot, pending, jobs)
            waiting = [
                worker for worker in self._workers if worker.job is not None or not worker.ready
            ]
            deadlines = [worker.deadline for worker in waiting if worker.job is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else PARENT_POLL_S
            signalled = set(wait([worker.inbox for worker in waiting], timeout))
            for worker in waiting:
                if worker.inbox in signalled:
                    self._receive(self._workers.index(worker), results, jobs)
            now = time.monotonic()
            for slot, worker in enumerate(self._workers):
                if worker.job is not None and now >= worker.deadline:
                    name = jobs[worker.job][0]
                    results[worker.job] = (0.0, f"{name} timed out after {self.timeout_s:g} s")
                    self._replace(slot)
        return results  # type: ignore[return-value]

    def _hand_over(self, slot: int, pending: deque[int], jobs: Sequence[Job]) -> None:
        worker, index = self._workers[slot], pending.popleft()
        try:
            worker.outbox.send(jobs[index])
        except OSError:  # died while idle: retry the job on a fresh worker
            pending.appendleft(index)
            self._replace(slot)
            return
        worker.job, worker.deadline = index, time.monotonic() + self.timeout_s

    def _receive(self, slot: int, results: list, jobs: Sequence[Job]) -> None:
        worker = self._workers[slot]
        try:
            message = worker.inbox.recv()
        except (EOFError, OSError):
            try:
                code = worker.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            if worker.job is not None:
                name = jobs[worker.job][0]
                results[worker.job] = (0.0, f"{name} killed its worker (exit code {code})")
            elif not worker.ready:
                self._start_failures += 1
                if self._start_failures >= MAX_START_FAILURES:
                    raise RuntimeError(
                        f"verifier workers die while starting (exit code {code}, "
                        f"{self._start_failures} times in a row); check that the verifiers "
                        f"{sorted(self.verifiers)} import in a fresh process (see its stderr)"
                    ) from None
            self._replace(slot)
            return
        if message == READY:
            worker.ready = True
            self._start_failures = 0
        else:
            results[worker.job] = message
            worker.job = None

    def _start_worker(self) -> _Worker:
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        bootstrap = (
            f"import sys; sys.path[:0] = {[path for path in sys.path if path]!r}; "
            "from cagrpo_ray.rewards.pool import serve_verifier_worker; "
            f"serve_verifier_worker({to_worker_r}, {from_worker_w}, {os.getpid()})"
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", bootstrap],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(to_worker_r, from_worker_w),
            )
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        worker = _Worker(
            process=process,
            inbox=Connection(from_worker_r, writable=False),
            outbox=Connection(to_worker_w, readable=False),
        )
        try:
            worker.outbox.send_bytes(self._setup)
        except OSError:
            pass  # died already: its inbox reports EOF and it is replaced
        return worker

    def _replace(self, slot: int) -> None:
        _kill(self._workers[slot])
        self.restarts += 1
        self._workers[slot] = self._start_worker()


def _kill(worker: _Worker) -> None:
    worker.process.kill()
    worker.process.wait()
    worker.inbox.close()
    worker.outbox.close()


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.outbox.close()  # EOF: an idle worker exits by itself
    deadline = time.monotonic() + 1.0
    for worker in workers:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _kill(worker)
