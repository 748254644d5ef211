"""Run an untrusted Python solution against test cases, isolated from the caller.

One fresh interpreter per solution (`python -I -X utf8 sandbox_harness.py`) runs every test
case of that solution. Layers, from the kernel up:

- **Process**: its own session (the whole process group is SIGKILLed when the wall-clock
  deadline passes or the run ends), `PR_SET_PDEATHSIG` so that it dies with the verifier
  worker that started it, an empty environment (`env={}`: no inherited variable, so no
  secret), and a fresh temporary working directory, removed afterwards.
- **Resource limits** (`setrlimit` before `exec`): address space (`RLIMIT_AS`), CPU seconds,
  file size, open files, no core dumps, and process count (`RLIMIT_NPROC`; the kernel counts
  every process of the user against it and does not apply it to root).
- **Network**: a new network namespace (`unshare(CLONE_NEWNET)`, inside a new user namespace
  when not root), which holds only a loopback that is down. Where the kernel refuses
  namespaces, the audit hook's refusal of every `socket.*` event is the only network barrier;
  `SandboxRun.isolation` reports which applied ("namespace" or "audit-hook").
- **CPython audit hook** (`sys.addaudithook`, installed before the solution runs): refuses
  fork/exec/spawn/subprocess/system, signals to other processes, sockets, ctypes and the
  `_posixsubprocess`/`resource` modules, writes outside the working directory, and reads
  outside it and Python's own installation (which keeps `/proc/<pid>/environ` of the
  caller out of reach). An audit hook is a guard against ordinary code, not a boundary
  against an attacker with native code; the layers above are the boundary.
- **Output**: each test case's stdout is capped in the child (`output_bytes`), and the caller
  reads at most a bounded number of bytes back, killing the child past that.

stdin/stdout cases are judged here, in the caller, which never sends the expected outputs to
the child. Assert-style tests run inside the child next to the solution, so a solution written
to tamper with the harness could fake their result; prefer stdin/stdout cases for RL.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("sandbox_harness.py")
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one solution's run; all of its test cases share them."""

    wall_s: float = 4.0  # wall-clock budget for all test cases together (seconds), counted
    # from the interpreter's first report, so that a slow start on a loaded machine is not
    # the solution's time
    start_s: float = 30.0  # the interpreter's start, up to that report
    memory_bytes: int = 1 << 30  # address space (RLIMIT_AS)
    max_processes: int = 32  # RLIMIT_NPROC, counted per user by the kernel; not applied to root
    output_bytes: int = 1 << 20  # stdout kept per test case; more fails the case
    file_bytes: int = 16 << 20  # largest file the solution may write (RLIMIT_FSIZE)
    open_files: int = 64  # RLIMIT_NOFILE


@dataclass
class SandboxRun:
    """What came back from one run. `outputs[i]` is None when case i did not finish."""

    isolation: str  # "namespace" or "audit-hook": what kept the network out
    outputs: list[str | None] = field(default_factory=list)
    case_status: list[str] = field(default_factory=list)  # "ok" or why the case failed
    assert_status: list[str] = field(default_factory=list)  # "ok" or why the test failed
    compile_error: str | None = None
    timed_out: bool = False
    truncated: bool = False  # the child sent more than the read cap and was killed


def run_solution(
    code: str,
    inputs: list[str] | None = None,
    asserts: list[str] | None = None,
    limits: SandboxLimits | None = None,
) -> SandboxRun:
    """Run `code` once per stdin string in `inputs`, then once followed by the `asserts`.

    Raises RuntimeError when the sandbox interpreter itself did not start (not the solution's
    fault, so not a zero score to hide). Linux only (prctl, unshare); it starts the child with
    a `preexec_fn`, so call it from a process whose other threads hold no locks, as the
    verifier workers are.
    """
    limits = limits or SandboxLimits()
    inputs, asserts = list(inputs or []), list(asserts or [])
    workdir = tempfile.mkdtemp(prefix="cagrpo-sandbox-")
    try:
        spec = {
            "code": code,
            "inputs": inputs,
            "asserts": asserts,
            "output_bytes": limits.output_bytes,
            "caller_netns": os.readlink("/proc/self/ns/net"),
        }
        Path(workdir, "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        raw, timed_out, truncated, exit_code = _run_child(
            workdir,
            limits,
            read_cap=(len(inputs) + len(asserts) + 3) * (limits.output_bytes + 4096),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    frames = _parse_frames(raw)
    if not frames or "isolation" not in frames[0][0]:
        raise RuntimeError(
            f"the sandbox interpreter sent no report (exit code {exit_code}, "
            f"{'timed out' if timed_out else 'within time'}); check that {sys.executable} runs "
            f"with {limits.memory_bytes} bytes of address space"
        )
    run = SandboxRun(
        isolation=frames[0][0]["isolation"],
        outputs=[None] * len(inputs),
        case_status=["did not finish"] * len(inputs),
        assert_status=["did not finish"] * len(asserts),
        timed_out=timed_out,
        truncated=truncated,
    )
    for header, payload in frames[1:]:
        if "compile_error" in header:
            run.compile_error = str(header["compile_error"])
        elif isinstance(header.get("case"), int) and 0 <= header["case"] < len(inputs):
            run.outputs[header["case"]] = payload.decode("utf-8", errors="replace")
            run.case_status[header["case"]] = str(header.get("status"))
        elif isinstance(header.get("assert"), int) and 0 <= header["assert"] < len(asserts):
            run.assert_status[header["assert"]] = str(header.get("status"))
    return run


def outputs_match(actual: str | None, expected: str) -> bool:
    """Whitespace-insensitive comparison: the same tokens in the same order."""
    return actual is not None and actual.split() == expected.split()


def _run_child(workdir: str, limits: SandboxLimits, read_cap: int):
    process = subprocess.Popen(
        [sys.executable, "-I", "-X", "utf8", str(HARNESS)],
        cwd=workdir,
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
        # preexec_fn is safe here: the verifier worker's only other thread (its parent watch)
        # sleeps without holding a lock that the child could need.
        preexec_fn=lambda: _confine_child(limits),
    )
    chunks, size, timed_out, truncated, started = [], 0, False, False, False
    deadline = time.monotonic() + limits.start_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if not selector.select(remaining):
                continue
            chunk = os.read(process.stdout.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if not started and b"\n" in chunk:  # the harness's first line: the solution's
                started, deadline = True, time.monotonic() + limits.wall_s  # clock starts
            if size > read_cap:
                truncated = True
                break
    _kill_group(process.pid)
    process.stdout.close()
    exit_code = process.wait()
    return b"".join(chunks), timed_out, truncated, exit_code


def _confine_child(limits: SandboxLimits) -> None:
    """Runs in the forked child before exec: limits, parent-death signal, network namespace."""
    cpu_s = int(limits.wall_s) + 1
    for limit, value in (
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, limits.max_processes),
    ):
        resource.setrlimit(limit, (value, value))
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _enter_network_namespace()


def _enter_network_namespace() -> None:
    """A new, empty network namespace; a refusal leaves the audit hook as the barrier."""
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    _LIBC.unshare(flags)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _parse_frames(raw: bytes) -> list[tuple[dict, bytes]]:
    """Header line + payload frames, stopping at the first malformed one."""
    frames, position = [], 0
    while position < len(raw):
        newline = raw.find(b"\n", position)
        if newline < 0:
            break
        try:
            header = json.loads(raw[position:newline])
        except ValueError:
            break
        if not isinstance(header, dict):
            break
        nbytes = header.get("nbytes", 0)
        if not isinstance(nbytes, int) or nbytes < 0 or newline + 1 + nbytes > len(raw):
            break
        frames.append((header, raw[newline + 1 : newline + 1 + nbytes]))
        position = newline + 1 + nbytes
    return frames
