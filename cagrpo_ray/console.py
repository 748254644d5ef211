"""What a run prints, and where the rest goes: the console and `runs/<name>/logs/`.

The console shows the project's own lines (its stages, one line a step, its warnings and
errors) and ends with the final table. What the libraries print goes to one file per process
in the run's `logs/` folder:

- each actor (`generator-<i>.log`, `learner-<rank>.log`, `reward.log`) points its file
  descriptors 1 and 2 at its file when it is built (`redirect_output`, from `LOG_FILE_ENV`,
  which the driver sets in the actor's `runtime_env`), before it imports vLLM or DeepSpeed;
  the processes it starts (vLLM's engine core and workers, the verifier workers) inherit them.
  The project's own warnings and errors in an actor also go to the actor's original stderr,
  which Ray forwards to the driver's console;
- the driver (`configure_driver_logging`) writes every log record to `driver.log` and shows
  on the console the project's records and other libraries' errors only: Ray's notices,
  transformers' messages and Python warnings stay in the file.

Every redirected process begins its part of the file with a header naming its role and pid (a
restarted actor appends to its file), so that `logs_for_error` can name the file of the actor
a Ray error came from.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path

LOG_DIR = "logs"
LOG_FILE_ENV = "CAGRPO_LOG_FILE"  # an actor's log file, set through its runtime_env
DRIVER_LOG = "driver.log"
PROJECT = "cagrpo_ray"  # the loggers whose records the console shows
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
HEADER = re.compile(r"^==== (?P<role>\S+): pid (?P<pid>\d+), ")
ROUTED_LIBRARIES = ("ray",)  # loggers with a console handler of their own, once imported
LATE_LIBRARIES = ("DeepSpeed",)  # ... that make theirs when imported, and log at once

_redirected: dict[str, Path] = {}  # "path": this process's log file, once redirected


def log_dir(run_dir: str | Path) -> Path:
    """The run's log folder, absolute (an actor's working directory may differ)."""
    return Path(run_dir).resolve() / LOG_DIR


def actor_env(logs: str | Path, role: str) -> dict[str, str]:
    """The env var that makes the actor `role` (e.g. "generator-0") write to its own file."""
    return {LOG_FILE_ENV: str(Path(logs) / f"{role}.log")}


def redirect_output(path: str | Path | None = None) -> Path | None:
    """Point this process's stdout and stderr (file descriptors 1 and 2, so everything it
    and its future subprocesses print) at `path`, or at `$CAGRPO_LOG_FILE`; without either,
    do nothing and return None. The project's log records go to the file (INFO and up) and,
    from WARNING up, also to the original stderr, naming the file: that is what Ray forwards
    to the driver's console. Call it first thing in an actor's constructor."""
    path = path or os.environ.get(LOG_FILE_ENV)
    if not path:
        return None
    path = Path(path)
    if _redirected.get("path") == path:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    first = "path" not in _redirected
    console_fd = os.dup(2) if first else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, _header(path.stem).encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _redirected["path"] = path
    logger = logging.getLogger(PROJECT)
    for handler in [h for h in logger.handlers if getattr(h, "_cagrpo_file", False)]:
        logger.removeHandler(handler)
    to_file = logging.StreamHandler(sys.stderr)  # Python's sys.stderr writes to fd 2
    to_file.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    to_file._cagrpo_file = True
    logger.addHandler(to_file)
    if console_fd is not None:
        console = logging.StreamHandler(os.fdopen(console_fd, "w", buffering=1))
        console.setLevel(logging.WARNING)
        console.setFormatter(_ConsoleFormatter())
        logger.addHandler(console)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root logger of a Ray worker would print them once more
    return path


def redirected(cls: type) -> type:
    """`cls` as a subclass whose constructor first calls `redirect_output()`: for an actor
    class that does not call it itself (the reward function)."""

    def __init__(self, *args, **kwargs):
        redirect_output()
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": cls.__doc__})


def configure_driver_logging(run_dir: str | Path) -> Path:
    """The driver's logging: every record (INFO and up) to `logs/driver.log`; on the console
    (stderr) the project's records and any library's errors. Ray's, DeepSpeed's and
    transformers' loggers stop printing through handlers of their own and go through the root
    logger's; Python warnings become log records; transformers shows no progress bars (a hub
    download still does). Returns the driver log's path."""
    path = log_dir(run_dir) / DRIVER_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(_header("driver"))
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_cagrpo_driver", False)]:
        root.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stderr)
    console.addFilter(for_console)
    to_file = logging.FileHandler(path, encoding="utf-8")
    for handler in (console, to_file):
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        handler._cagrpo_driver = True
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    import ray  # noqa: F401  (importing Ray installs its handler, removed next)

    for name in ROUTED_LIBRARIES:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
    for name in LATE_LIBRARIES:  # e.g. DeepSpeed, which transformers imports to read a config
        library = logging.getLogger(name)
        if not any(isinstance(f, _ToRoot) for f in library.filters):
            library.addFilter(_ToRoot())
    try:
        import huggingface_hub.utils
        import transformers.utils.logging as hf_logging
    except ImportError:
        return path
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
    huggingface_hub.utils.enable_progress_bars()  # a model download still shows its progress
    return path


def for_console(record: logging.LogRecord) -> bool:
    """Whether the driver's console shows `record`: the project's, or any error."""
    project = record.name == PROJECT or record.name.startswith(PROJECT + ".")
    return project or record.name == "__main__" or record.levelno >= logging.ERROR


def logs_for_error(error: BaseException, logs: str | Path) -> list[Path]:
    """The actors' log files whose process a Ray error names (by the pid in its message or
    traceback, matched against each file's headers), in name order."""
    text = "".join(traceback.format_exception(error))
    pids = set(re.findall(r"\bpid[=: ]+(\d+)", text))
    found = []
    for path in sorted(Path(logs).glob("*.log")):
        if path.name == DRIVER_LOG:
            continue
        with path.open(errors="replace") as f:
            if any((m := HEADER.match(line)) and m["pid"] in pids for line in f):
                found.append(path)
    return found


def _header(role: str) -> str:
    return f"==== {role}: pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n"


class _ToRoot(logging.Filter):
    """On a library's logger: hands each record to the root logger's handlers instead of the
    library's own (which DeepSpeed makes when imported, printing to stdout)."""

    def filter(self, record: logging.LogRecord) -> bool:
        logging.getLogger().handle(record)
        return False


class _ConsoleFormatter(logging.Formatter):
    """An actor's warning or error for the console, with where its full output is."""

    def __init__(self):
        super().__init__(FORMAT, DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        return f"{super().format(record)} (full output: {_redirected.get('path')})"
