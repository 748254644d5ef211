"""A step's token records, from the batch the learner trained on and what it kept.

The driver holds the batch (its Arrow table and the padded learner batch) and the tokenizer;
the learner ranks keep, for the inspected groups, their per-token values of the step (learner
log-prob, entropy, covariance, kernel weight, selections, IS weight, clipped). `capture_step`
joins the two and writes `RUN_DIR/inspect/step_N.parquet` (`records.py`), the same way on one
machine and on a cluster: the values travel with the learner's results to the driver.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from cagrpo_ray.inspect.records import records_from_arrays, select_groups, write_step


def groups_to_inspect(group_ids, count: int, step: int) -> list[int]:
    """`count` whole groups of the batch (the same ones for the same batch and step)."""
    ids = np.asarray(group_ids)
    return sorted({int(g) for g in ids[select_groups(ids, count, seed=step)]})


def capture_step(
    run_dir,
    step: int,
    table: pa.Table,
    batch: dict,
    kept: dict,
    tokenizer,
    metadata: dict,
) -> int:
    """Write the inspected groups of learner step `step`; returns the responses written.

    table: the batch's rows as taken from the buffer (sorted by group id, like `batch`);
    batch: its learner tensors (`to_learner_batch`); kept: `LearnerGroup.inspection()`, rows
    of the inspected groups in group order, [r, T] arrays aligned with the batch's columns.
    """
    if not kept:
        return 0
    group_ids = np.asarray(batch["group_ids"])
    rows = np.flatnonzero(np.isin(group_ids, kept["group_ids"]))
    if not np.array_equal(group_ids[rows], kept["group_ids"]):
        raise ValueError("the learners kept rows in another order than the batch holds them")
    mask = batch["response_mask"].numpy()[rows]
    input_ids = batch["input_ids"].numpy()[rows]
    texts = [
        [_shown(tokenizer, t) for t in tokenizer.convert_ids_to_tokens(row[m].tolist())]
        for row, m in zip(input_ids, mask, strict=True)
    ]
    prompt_ids = table.column("prompt_token_ids").to_pylist()
    environment = _environment_segments(table, rows, mask, tokenizer)
    records = records_from_arrays(
        step=step,
        group_ids=group_ids[rows],
        prompt_uids=[table.column("prompt_uid")[int(r)].as_py() for r in rows],
        prompt_texts=[tokenizer.decode(prompt_ids[int(r)]) for r in rows],
        rewards=table.column("reward").to_numpy()[rows],
        correct=table.column("correct").to_numpy(zero_copy_only=False)[rows],
        advantages=batch["advantages"].numpy()[rows],  # as trained (after any batch stage)
        policy_version=table.column("policy_version").to_numpy()[rows],
        finish_reason=[table.column("finish_reason")[int(r)].as_py() for r in rows],
        token_ids=input_ids,
        token_texts=texts,
        response_mask=mask,
        behavior_logprob=batch["behavior_logprobs"].numpy()[rows],
        logprob=kept["logprob"],
        entropy=kept["entropy"],
        cov=kept["cov"],
        weight=kept["weight"],
        clip_cov=kept["clip_cov"],
        kl_cov=kept["kl_cov"],
        is_weight=kept["is_weight"],
        clipped=kept["clipped"],
        environment=environment,
    )
    write_step(run_dir, step, records, metadata)
    return records.num_rows


def _shown(tokenizer, token: str) -> str:
    """A token as text: byte-level markers (Ġ, Ċ) decoded, so that a space is a space."""
    try:
        return tokenizer.convert_tokens_to_string([token])
    except Exception:  # a tokenizer without the byte-level table
        return token


def _environment_segments(table, rows, mask, tokenizer) -> list[list[tuple[int, str]]]:
    """Per row: the environment's runs of tokens (its `policy_mask` False) as (the number of
    trained tokens before the run, its text), for the page to show between the tokens."""
    policy_masks = table.column("policy_mask").to_pylist()
    responses = table.column("response_token_ids").to_pylist()
    out = []
    for k, r in enumerate(rows):
        policy, tokens = policy_masks[int(r)], responses[int(r)]
        segments: list[tuple[int, str]] = []
        if policy is not None and mask[k].any():
            trained, start = 0, None
            for t, mine in enumerate([*policy, True]):
                if not mine and start is None:
                    start = t
                elif mine and start is not None:
                    segments.append((trained, tokenizer.decode(tokens[start:t])))
                    start = None
                trained += bool(mine) and t < len(policy)
        out.append(segments)
    return out
