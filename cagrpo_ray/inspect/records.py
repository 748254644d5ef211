"""The token inspector's records: one Parquet file per inspected step, one row per response.

    RUN_DIR/inspect/step_{step:06d}.parquet

Each row is a response of a whole prompt group, with its per-token values as list columns of
equal length (one element per response token, in order). The file's schema metadata holds,
under the key `cagrpo_inspect`, the JSON object {"step", "policy_loss", "cov_scope",
"run_name"}: `cov_scope` says over which token set S the covariance c and the kernel weight w~
were taken ("group" or "batch").

The learner calls `select_groups` to pick the groups of a step, `records_from_arrays` to turn
its padded [B, T] tensors into a table, and `write_step` to store it; the page and the server
read it back with `inspected_steps` and `read_step`. Nothing here imports torch: torch tensors
are accepted through their `.numpy()`.

Size, measured: about 36 bytes a token with zstd (float32 values barely compress), so 58 KB
for an inspected group of 8 responses of 200 tokens, 145 KB for 500 tokens (`page.py` has the
page's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

METADATA_KEY = b"cagrpo_inspect"
METADATA_FIELDS = ("step", "policy_loss", "cov_scope", "run_name")
INSPECT_DIR = "inspect"

# The per-token values the learner always has (the others default to 1.0 or False).
TOKEN_VALUES = ("behavior_logprob", "logprob", "entropy", "cov")

INSPECT_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("group_id", pa.int64()),
        ("prompt_uid", pa.string()),
        ("prompt_text", pa.string()),
        ("response_index", pa.int32()),  # place of the response in its group, 0..G-1
        ("reward", pa.float32()),
        ("correct", pa.bool_()),
        ("advantage", pa.float32()),
        ("policy_version", pa.int64()),  # version of the weights that sampled the response
        ("finish_reason", pa.string()),  # "stop" | "length"
        ("token_ids", pa.list_(pa.int32())),
        ("tokens", pa.list_(pa.string())),  # each token's text, decoded alone
        ("behavior_logprob", pa.list_(pa.float32())),  # the generator's log-prob
        ("logprob", pa.list_(pa.float32())),  # the learner's log-prob before the update
        ("entropy", pa.list_(pa.float32())),  # nats, of the learner's next-token distribution
        ("cov", pa.list_(pa.float32())),  # c = (logp - mean_S logp) * (A - mean_S A)
        ("weight", pa.list_(pa.float32())),  # CA-GRPO's w~; 1 for other losses
        ("clip_cov", pa.list_(pa.bool_())),  # chosen by Clip-Cov (its gradient is dropped)
        ("kl_cov", pa.list_(pa.bool_())),  # chosen by KL-Cov (gets the KL penalty)
        ("is_weight", pa.list_(pa.float32())),  # truncated behaviour-to-proximal IS weight
        ("clipped", pa.list_(pa.bool_())),  # the PPO ratio was clipped
        # A multi-turn episode's environment text (tool results: context, no loss, no value),
        # each before the response token `at` of the lists above; null for single-turn rows.
        ("environment", pa.list_(pa.struct([("at", pa.int32()), ("text", pa.string())]))),
    ]
)


def step_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / INSPECT_DIR / f"step_{step:06d}.parquet"


def inspected_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps with a record under RUN_DIR/inspect, ascending ([] if there is none)."""
    folder = Path(run_dir) / INSPECT_DIR
    if not folder.is_dir():
        return []
    steps = []
    for path in folder.glob("step_*.parquet"):
        number = path.stem.removeprefix("step_")
        if number.isdigit():
            steps.append(int(number))
    return sorted(steps)


def write_step(
    run_dir: str | os.PathLike,
    step: int,
    table_or_columns: pa.Table | Mapping[str, Sequence],
    metadata: Mapping[str, object],
) -> Path:
    """Write one inspected step to RUN_DIR/inspect/step_{step:06d}.parquet and return the path.

    `table_or_columns` is a table or a {column: values} mapping with every `INSPECT_SCHEMA`
    column; `metadata` holds "policy_loss", "cov_scope" and "run_name" ("step" is set from
    `step`). The file is written beside its final name and renamed, so a reader (the live
    server) never sees half of it.
    """
    missing = [key for key in METADATA_FIELDS[1:] if key not in metadata]
    if missing:
        raise ValueError(f"inspect metadata lacks {', '.join(missing)}; it needs {METADATA_FIELDS}")
    if isinstance(table_or_columns, pa.Table):
        table = table_or_columns
    else:
        table = pa.table(dict(table_or_columns))
    absent = [name for name in INSPECT_SCHEMA.names if name not in table.column_names]
    if absent:
        raise ValueError(f"inspect records lack the columns {', '.join(absent)}")
    table = table.select(INSPECT_SCHEMA.names).cast(INSPECT_SCHEMA)
    meta = {key: metadata[key] for key in METADATA_FIELDS[1:]} | {"step": int(step)}
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    path = step_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    pq.write_table(table, partial, compression="zstd")
    os.replace(partial, path)
    return path


def read_step(run_dir: str | os.PathLike, step: int | None = None) -> tuple[pa.Table, dict]:
    """(table, metadata) of an inspected step; `step=None` reads the newest one.

    Raises FileNotFoundError naming the run directory, or the step and the steps there are;
    ValueError for a file without the metadata `write_step` writes."""
    if not Path(run_dir).is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    steps = inspected_steps(run_dir)
    if not steps:
        raise FileNotFoundError(
            f"{run_dir} has no inspected step ({Path(run_dir) / INSPECT_DIR}/step_*.parquet); "
            "the learner writes them every metrics.inspect_every steps"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        shown = ", ".join(map(str, steps))
        raise FileNotFoundError(f"step {step} was not inspected in {run_dir}; inspected: {shown}")
    path = step_path(run_dir, step)
    raw = pq.read_schema(path).metadata or {}
    if METADATA_KEY not in raw:
        raise ValueError(f"{path} has no {METADATA_KEY.decode()} metadata (written by write_step)")
    return pq.read_table(path, schema=INSPECT_SCHEMA), json.loads(raw[METADATA_KEY])


def select_groups(group_ids, k: int, seed: int) -> np.ndarray:
    """Rows of k whole prompt groups drawn without replacement (all of them if there are fewer),
    the same ones for the same `group_ids`, `k` and `seed`.

    Args:
        group_ids: [B] prompt group of each row.
    Returns:
        [rows] int64 row indices, ascending, every row of each chosen group.
    """
    groups = _numpy(group_ids).astype(np.int64)
    unique = np.unique(groups)
    rng = np.random.default_rng(seed)
    chosen = rng.choice(unique, size=min(k, unique.size), replace=False)
    return np.flatnonzero(np.isin(groups, chosen))


def records_from_arrays(
    *,
    step: int,
    group_ids,
    prompt_uids: Sequence[str],
    prompt_texts: Sequence[str],
    rewards,
    correct,
    advantages,
    policy_version,
    finish_reason: Sequence[str],
    token_ids,
    token_texts: Sequence[Sequence[str]],
    response_mask,
    behavior_logprob,
    logprob,
    entropy,
    cov,
    weight=None,
    clip_cov=None,
    kl_cov=None,
    is_weight=None,
    clipped=None,
    environment=None,
) -> pa.Table:
    """The `INSPECT_SCHEMA` table of B responses from padded numpy arrays or torch tensors.

    Args:
        group_ids, rewards, correct, advantages, policy_version: [B].
        prompt_uids, prompt_texts, finish_reason: B strings.
        token_ids, response_mask: [B, T]; the mask marks each row's response tokens (a learner
            batch's [B, L] with prompt tokens masked out works as is).
        token_texts: B lists, row i holding one text per response token of row i.
        behavior_logprob, logprob, entropy, cov, weight, clip_cov, kl_cov, is_weight, clipped:
            [B, T], read at the mask. None for weight or is_weight means 1.0 everywhere (a loss
            without kernel weights, on-policy samples); None for a flag means False.
        environment: None, or B lists of (at, text): the environment's text shown before the
            row's response token `at` (a multi-turn episode's tool results).

    Rows keep their order; `response_index` counts the rows of each group in that order.
    """
    mask = _numpy(response_mask).astype(bool)
    lengths = mask.sum(axis=1)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    texts = [list(row) for row in token_texts]
    for row, (row_texts, n) in enumerate(zip(texts, lengths, strict=True)):
        if len(row_texts) != n:
            raise ValueError(f"token_texts[{row}] has {len(row_texts)} texts for {n} tokens")

    def tokens(values, dtype, default=None) -> pa.ListArray:
        """A list column of `values` at the mask; `default` everywhere when values is None."""
        if values is None and default is None:
            raise ValueError("records_from_arrays: only weight, is_weight and flags may be None")
        flat = np.full(int(offsets[-1]), default) if values is None else _numpy(values)[mask]
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype)))

    groups = _numpy(group_ids).astype(np.int64)
    response_index = np.zeros(groups.size, dtype=np.int32)
    seen: dict[int, int] = {}
    for row, group in enumerate(groups.tolist()):
        response_index[row] = seen.get(group, 0)
        seen[group] = response_index[row] + 1
    columns = {
        "step": np.full(groups.size, step, dtype=np.int64),
        "group_id": groups,
        "prompt_uid": list(prompt_uids),
        "prompt_text": list(prompt_texts),
        "response_index": response_index,
        "reward": _numpy(rewards).astype(np.float32),
        "correct": _numpy(correct).astype(bool),
        "advantage": _numpy(advantages).astype(np.float32),
        "policy_version": _numpy(policy_version).astype(np.int64),
        "finish_reason": list(finish_reason),
        "token_ids": tokens(token_ids, np.int32),
        "tokens": pa.ListArray.from_arrays(
            pa.array(offsets), pa.array([t for row in texts for t in row], pa.string())
        ),
    }
    for name, values in zip(TOKEN_VALUES, (behavior_logprob, logprob, entropy, cov), strict=True):
        columns[name] = tokens(values, np.float32)
    columns["weight"] = tokens(weight, np.float32, 1.0)
    columns["clip_cov"] = tokens(clip_cov, bool, False)
    columns["kl_cov"] = tokens(kl_cov, bool, False)
    columns["is_weight"] = tokens(is_weight, np.float32, 1.0)
    columns["clipped"] = tokens(clipped, bool, False)
    columns["environment"] = pa.array(
        [
            None if not row else [{"at": at, "text": text} for at, text in row]
            for row in (environment or [None] * groups.size)
        ],  # fmt: skip
        INSPECT_SCHEMA.field("environment").type,
    )
    return pa.table(columns).cast(INSPECT_SCHEMA)


def _numpy(values) -> np.ndarray:
    """A numpy array of a numpy array, a sequence or a torch tensor (any device, any dtype)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu()
        values = values.float() if values.is_floating_point() else values
        return values.numpy()
    return np.asarray(values)
