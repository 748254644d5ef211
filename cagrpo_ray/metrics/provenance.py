"""Where a measurement was made: the machine, the commit, the time; and a results-table writer.

Benchmarks and experiments record these next to every number so that a result can be traced
back to the code and the hardware it came from. Standard library only: nothing here may pull in
torch or ray, so that a script can describe its machine before it imports anything heavy.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path


def checkout() -> Path:
    """The git checkout the measured code comes from: the one the package is in (an editable
    install, or a script run from the repository), else the working directory (an installed
    package, measured from the checkout the script was started in)."""
    package = Path(__file__).resolve().parents[1]
    if (package.parent / ".git").exists():
        return package.parent
    return Path.cwd()


def _proc_value(path: str, key: str) -> str | None:
    """The value of the first "key: value" line of a /proc file; None off Linux or without it."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), None)


def machine() -> dict[str, str]:
    """What the numbers were measured on: `nproc` (cores this process may use), CPU model,
    RAM in GiB, OS and Python version; `torch` too when torch is installed (read from its
    package metadata, so torch is never imported)."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem_kib = int((_proc_value("/proc/meminfo", "MemTotal") or "0 kB").split()[0])
    described = {
        "nproc": str(nproc),
        "cpu": _proc_value("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "ram_gib": f"{mem_kib / 2**20:.1f}",
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        described["torch"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    return described


def describe_machine(m: dict[str, str] | None = None) -> str:
    """One line for a results file, e.g. "2 cores (AMD EPYC), python 3.11.7, 23.4 GiB, torch
    2.13.0+cpu", of `m` (a dict from `machine()`, possibly recorded earlier) or of this machine.
    """
    m = machine() if m is None else m
    line = f"{m.get('nproc', '?')} cores ({m.get('cpu', '?')}), python {m.get('python', '?')}"
    line += f", {m['ram_gib']} GiB" if "ram_gib" in m else ""
    return line + (f", torch {m['torch']}" if "torch" in m else "")


def git_commit(
    root: Path | None = None,
    paths: Sequence[str] = ("cagrpo_ray", "configs"),
    *,
    short: bool = True,
) -> str:
    """The commit checked out at `root` (default `checkout()`; short hash unless
    `short=False`), followed by " (<paths> modified)" when any of `paths` has uncommitted
    changes; "unknown" outside a git checkout or without git."""
    root = checkout() if root is None else root

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, check=True, capture_output=True, text=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", *(["--short"] if short else []), "HEAD")
        dirty = git("status", "--porcelain", "--", *paths) if paths else ""
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (f" ({' or '.join(p + '/' for p in paths)} modified)" if dirty else "")


def utc_now() -> str:
    """The current time in UTC, to the second, as ISO 8601 ("2026-11-30T03:07:48Z")."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (no trailing newline); cells are written with `str`."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def report(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    out: Path | None = None,
    notes: Sequence[str] = (),
    command: str | None = None,
) -> str:
    """Print `title`, the rows as an aligned table and the notes to stdout; when `out` is given,
    also append to it a markdown section: "## title", the date, machine and commit, the command,
    the table, then each note as its own paragraph. Returns that section."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    aligned = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    aligned.insert(1, "  ".join("-" * w for w in widths))
    print("\n\n".join([title, "\n".join(line.rstrip() for line in aligned), *notes]), flush=True)

    stamp = f"{utc_now()[:10]}, {describe_machine()}; commit {git_commit()}"
    parts = [f"## {title}", stamp, *([f"Command: `{command}`"] if command else [])]
    section = "\n\n".join([*parts, markdown_table(headers, rows), *notes]) + "\n"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        separator = "\n" if out.exists() and out.stat().st_size else ""
        with out.open("a") as f:
            f.write(separator + section)
    return section
