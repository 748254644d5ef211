"""Atomic checkpoint directories: written aside, published by a rename, verified on load.

Under a run's checkpoint root:

    step_000010/            a finished checkpoint: its files and MANIFEST.json, written last
    .partial-step_000012/   one being written, or left by a crash: never read, removed by the
                            next write
    latest                  the name of the newest finished checkpoint, replaced atomically

A checkpoint is finished once its manifest is in it and its directory has its final name:
the files are written into `.partial-<name>/`, flushed to disk, listed in the manifest (each
file's size in bytes, and the sha256 of files up to `HASH_LIMIT_BYTES`), and the directory
is renamed. A crash at any point leaves either the previous checkpoints untouched or the new
one complete; `latest` is written after the rename (write to a temporary file, then
`os.replace`).

Loading takes the newest checkpoint that verifies: its manifest reads, every file it lists is
there with its size (and hash, where one was recorded). One that does not verify is reported
(a warning naming the file and what is wrong) and the one before it is used; when none
verifies, loading fails and says why, rather than starting the run afresh. A run whose
checkpoints all predate manifests resumes from the one `latest` names, unverified; once one
checkpoint has a manifest, a directory without one is incomplete. What the manifest cannot
see: a large file corrupted in place without a change of size (hashing tens of GB of learner
state at every checkpoint would cost more than the write).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
MANIFEST_FORMAT = 1
HASH_LIMIT_BYTES = 64 * 2**20  # files this small are hashed too (the trainer state, buffers)


class CheckpointError(RuntimeError):
    """A checkpoint directory does not verify against its manifest."""


def checkpoint_names(root: Path) -> list[str]:
    """The checkpoint directories (`step_<N>`) under `root`, oldest (smallest N) first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.glob("step_*") if p.is_dir()]
    return sorted(names, key=lambda n: (int(n[5:]) if n[5:].isdigit() else -1, n))


@contextmanager
def write_checkpoint(root: str | Path, name: str, keep: int) -> Iterator[Path]:
    """Yield a temporary directory to write checkpoint `name` into; when the block ends
    without an error, publish it as `root/name` (manifest, rename, `latest`) and keep only the
    newest `keep` checkpoints. On an error the temporary directory is removed and nothing
    else changes.

    Every process that writes into the directory (each learner rank) must have finished when
    the block ends.
    """
    if keep < 1:
        raise ValueError(f"run.keep_checkpoints must be >= 1, got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{PARTIAL_PREFIX}*"):  # an earlier write that never finished
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    partial = root / f"{PARTIAL_PREFIX}{name}"
    partial.mkdir()
    try:
        yield partial
        write_manifest(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    final = root / name
    if final.exists():  # the same step written again: the new one replaces it
        replaced = root / f"{PARTIAL_PREFIX}replaced-{name}"
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        partial.rename(final)
    _fsync_dir(root)
    _write_atomically(root / LATEST, name)
    for old in checkpoint_names(root)[:-keep]:
        shutil.rmtree(root / old, ignore_errors=True)


def write_manifest(directory: Path) -> dict:
    """Flush every file under `directory` to disk and record it in MANIFEST.json (written
    last, itself flushed); returns the manifest."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        entry = {"bytes": path.stat().st_size}
        if entry["bytes"] <= HASH_LIMIT_BYTES:
            entry["sha256"] = _sha256(path)
        files[rel] = entry
    for sub in sorted({p.parent for p in directory.rglob("*")} | {directory}):
        _fsync_dir(sub)
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    _write_atomically(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def verify(directory: str | Path) -> list[str]:
    """What is wrong with checkpoint `directory` against its manifest (empty: it verifies)."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return [f"{directory / MANIFEST} is missing (the write did not finish)"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{directory / MANIFEST} is unreadable: {exc}"]
    problems = []
    for rel, entry in sorted(files.items()):
        path = directory / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(f"{path} has {size} bytes, the manifest says {entry['bytes']}")
        elif "sha256" in entry and _sha256(path) != entry["sha256"]:
            problems.append(f"{path} does not match its sha256 in the manifest")
    return problems


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that verifies; None when `root` has no checkpoint.

    Each newer one that does not verify is reported with a warning and passed over; when none
    verifies, `CheckpointError` lists what is wrong with each (rather than a silent fresh
    start). A run whose checkpoints all predate manifests resumes from the one `latest`
    names, unverified.
    """
    root = Path(root)
    named = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    names = checkpoint_names(root)
    predates_manifests = not any((root / name / MANIFEST).exists() for name in names)
    rejected = []
    for name in reversed(names):
        path = root / name
        if predates_manifests and name == named:
            log.warning("checkpoint %s has no manifest (written before manifests): "
                        "using it unverified", path)  # fmt: skip
            return path
        problems = verify(path)
        if not problems:
            if named is not None and name != named:
                log.warning("checkpoint %s is complete but %s names %s (the run stopped "
                            "between the two writes); using %s", path, root / LATEST, named,
                            name)  # fmt: skip
            return path
        log.warning("checkpoint %s is incomplete or corrupt, using the one before it: %s",
                    path, "; ".join(problems))  # fmt: skip
        rejected.append(f"{name}: {'; '.join(problems)}")
    if rejected:
        raise CheckpointError(
            f"no checkpoint under {root} is complete, so the run cannot resume: "
            + " | ".join(rejected)
        )
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` by `text` so that a reader sees the old or the new content, never a
    part: written to a temporary file beside it, flushed, then renamed over it."""
    tmp = path.with_name(f"{PARTIAL_PREFIX}{path.name}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename is durable only once its directory is)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
