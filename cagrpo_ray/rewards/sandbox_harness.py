"""Runs inside the sandbox interpreter (`python -I sandbox_harness.py`); trusted, self-contained.

Reads `spec.json` from its working directory and deletes it, moves its report channel off fd 1,
points fds 0-2 at /dev/null, installs the audit hook, then runs the solution: once per stdin
case (fresh globals, `sys.stdin`/`sys.stdout` replaced) or once followed by assert statements.

Report frames on the original stdout: a JSON header line, then `nbytes` raw bytes if the
header says so. The caller, not this script, decides whether an output is right: the expected
outputs never enter this process.
"""

import builtins
import io
import json
import os
import sys

BLOCKED_IMPORTS = frozenset(
    {
        "ctypes",
        "_ctypes",
        "_posixsubprocess",
        "resource",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_testcapi",
        "_testinternalcapi",
    }
)
BLOCKED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.exec",
        "os.system",
        "subprocess.Popen",
        "os.kill",
        "os.killpg",
        "os.chroot",
    }
)
BLOCKED_EVENT_PREFIXES = ("socket.", "ctypes.", "resource.")
MUTATING_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.replace",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.link",
        "os.symlink",
        "os.truncate",
        "os.utime",
        "os.mkfifo",
        "os.mknod",
        "os.setxattr",
        "os.removexattr",
        "shutil.rmtree",
    }
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class OutputLimitExceeded(BaseException):
    """Raised on a write past the output cap; a BaseException so `except Exception` can't eat it."""


class CappedBytes(io.BytesIO):
    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def write(self, data) -> int:
        if self.tell() + len(data) > self.limit:
            raise OutputLimitExceeded(f"more than {self.limit} bytes of output")
        return super().write(data)


def _resolved(path) -> str | None:
    if isinstance(path, int):
        return None
    return os.path.realpath(os.path.abspath(os.fsdecode(path)))


def _under(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def make_audit_hook(write_roots, read_roots):
    def hook(event, args):
        if event == "import" and args and args[0] in BLOCKED_IMPORTS:
            raise ImportError(f"import of {args[0]!r} is not allowed in the sandbox")
        if event in BLOCKED_EVENTS or event.startswith(BLOCKED_EVENT_PREFIXES):
            raise PermissionError(f"{event} is not allowed in the sandbox")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            resolved = _resolved(path)
            if resolved is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS
            )
            if not _under(resolved, write_roots if writing else read_roots):
                raise PermissionError(
                    f"{'writing' if writing else 'reading'} {resolved} is not allowed"
                )
        elif event in MUTATING_EVENTS:
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    if not _under(_resolved(arg), write_roots):
                        raise PermissionError(f"{event} on {arg!r} is not allowed in the sandbox")

    return hook


def main() -> None:
    with open("spec.json", encoding="utf-8") as spec_file:
        spec = json.load(spec_file)
    os.unlink("spec.json")
    report_stream = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)

    def report(header: dict, payload: bytes | None = None) -> None:
        if payload is not None:
            header["nbytes"] = len(payload)
        report_stream.write(json.dumps(header).encode() + b"\n")
        if payload is not None:
            report_stream.write(payload)
        report_stream.flush()

    workdir = os.path.realpath(os.getcwd())
    own_netns = os.readlink("/proc/self/ns/net")
    report({"isolation": "namespace" if own_netns != spec["caller_netns"] else "audit-hook"})

    read_roots = {workdir, os.devnull, "/dev/urandom", "/dev/zero", "/usr/share/zoneinfo"}
    read_roots |= {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    read_roots |= {os.path.realpath(p) for p in sys.path if p and os.path.exists(p)}
    sys.dont_write_bytecode = True
    sys.addaudithook(make_audit_hook({workdir, os.devnull}, read_roots))

    try:
        solution = compile(spec["code"], "<solution>", "exec")
    except BaseException as error:  # SyntaxError, ValueError on NUL bytes, RecursionError, ...
        report({"compile_error": f"{type(error).__name__}: {error}"})
        return

    output_bytes = spec["output_bytes"]
    for index, case_input in enumerate(spec["inputs"]):
        stdout_bytes = CappedBytes(output_bytes)
        sys.stdin = io.TextIOWrapper(io.BytesIO(case_input.encode()), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(stdout_bytes, encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(CappedBytes(output_bytes), encoding="utf-8")
        status = _run(solution, {"__name__": "__main__", "__builtins__": builtins})
        try:
            sys.stdout.flush()
        except BaseException as error:
            if status == "ok":
                status = type(error).__name__
        report({"case": index, "status": status}, stdout_bytes.getvalue())

    if spec["asserts"]:
        sys.stdout = io.TextIOWrapper(CappedBytes(output_bytes), encoding="utf-8")
        sys.stderr = io.TextIOWrapper(CappedBytes(output_bytes), encoding="utf-8")
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        setup = _run(solution, namespace)
        for index, statement in enumerate(spec["asserts"]):
            if setup != "ok":
                report({"assert": index, "status": f"solution failed: {setup}"})
                continue
            try:
                test = compile(statement, f"<test {index}>", "exec")
            except BaseException as error:
                report({"assert": index, "status": f"bad test: {type(error).__name__}"})
                continue
            report({"assert": index, "status": _run(test, namespace)})
    report({"done": True})


def _run(code, namespace: dict) -> str:
    try:
        exec(code, namespace)
    except SystemExit as error:
        return "ok" if error.code in (None, 0) else f"SystemExit({error.code!r})"
    except OutputLimitExceeded:
        return "output limit"
    except BaseException as error:
        return type(error).__name__
    return "ok"


if __name__ == "__main__":
    main()
