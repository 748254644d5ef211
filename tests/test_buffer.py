"""RolloutBuffer: whole groups, FIFO, staleness, Parquet, and the padded learner batch."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cagrpo_ray.rollout.buffer import RolloutBuffer, group_record_batch, to_learner_batch
from cagrpo_ray.types import Completion

pytestmark = pytest.mark.unit


def random_group(rng, group_id, size=4, version=0):
    prompt = rng.integers(3, 50, size=rng.integers(1, 9)).tolist()
    completions = []
    for _ in range(size):
        length = int(rng.integers(0, 12))
        completions.append(
            Completion(
                prompt_token_ids=prompt,
                token_ids=rng.integers(3, 50, size=length).tolist(),
                logprobs=(-rng.random(length) * 5).tolist(),
                text="",
                finish_reason="stop" if rng.random() < 0.5 else "length",
                policy_version=version,
            )
        )
    rewards = rng.integers(0, 2, size=size).astype(float).tolist()
    return group_record_batch(
        f"p{group_id}", group_id, completions, rewards, [r > 0 for r in rewards], [0.0] * size
    ), completions


def test_learner_batch_matches_a_row_by_row_reference():
    rng = np.random.default_rng(0)
    for trial in range(20):
        buffer = RolloutBuffer()
        groups = [random_group(rng, g + 100 * trial) for g in range(int(rng.integers(1, 6)))]
        for batch, _ in groups:
            buffer.add(batch)
        table = buffer.take_ids(buffer.group_ids())
        out = to_learner_batch(table, pad_token_id=0)
        rows = [c for _, cs in groups for c in cs]
        width = max(len(c.prompt_token_ids) + len(c.token_ids) for c in rows)
        assert out["input_ids"].shape == (len(rows), width)
        for i, c in enumerate(rows):
            p, r = len(c.prompt_token_ids), len(c.token_ids)
            expected = c.prompt_token_ids + c.token_ids + [0] * (width - p - r)
            assert out["input_ids"][i].tolist() == expected
            assert out["attention_mask"][i].tolist() == [1] * (p + r) + [0] * (width - p - r)
            assert out["response_mask"][i].tolist() == [False] * p + [True] * r + [False] * (
                width - p - r
            )
            np.testing.assert_allclose(
                out["behavior_logprobs"][i, p : p + r].numpy(), c.logprobs, rtol=1e-6
            )
            assert float(out["behavior_logprobs"][i].abs().sum()) == pytest.approx(
                float(np.abs(c.logprobs).sum()), rel=1e-5
            )


def test_stale_groups_are_dropped_and_counted_and_the_rest_leave_whole():
    rng = np.random.default_rng(1)
    buffer = RolloutBuffer()
    for g, version in enumerate([0, 1, 2, 2, 3]):
        buffer.add(random_group(rng, g, version=version)[0])
    assert len(buffer) == 5 and buffer.to_table().num_rows == 20
    buffer.drop_stale(2)
    assert buffer.dropped_stale == 2 and buffer.group_ids() == [2, 3, 4]
    table = buffer.take_ids([2, 3])
    assert table.column("group_id").to_pylist() == [2] * 4 + [3] * 4
    with pytest.raises(KeyError, match=r"\[3\]"):  # taken already: nothing else is lost
        buffer.take_ids([3])
    assert len(buffer) == 1


def test_groups_leave_by_id_and_the_rest_keep_their_order():
    rng = np.random.default_rng(2)
    buffer = RolloutBuffer()
    groups = {g: random_group(rng, g)[0] for g in [5, 2, 7, 3]}  # arrival order
    for group in groups.values():
        buffer.add(group)
    assert buffer.group_ids() == [5, 2, 7, 3]
    table = buffer.take_ids([2, 3])
    assert table.equals(pa.Table.from_batches([groups[2], groups[3]]))
    assert buffer.group_ids() == [5, 7]
    with pytest.raises(KeyError, match=r"groups \[3\] are not buffered"):
        buffer.take_ids([7, 3])
    assert buffer.group_ids() == [5, 7]  # a refused take removes nothing


def test_parquet_dump_and_reload_keep_groups(tmp_path):
    rng = np.random.default_rng(3)
    buffer = RolloutBuffer()
    for g in range(3):
        buffer.add(random_group(rng, g, size=int(rng.integers(2, 5)))[0])
    path = buffer.dump_parquet(tmp_path / "rollouts.parquet")
    table = pq.read_table(path)
    assert table.equals(buffer.to_table())
    other = RolloutBuffer()
    other.load_table(table)
    assert len(other) == 3
    assert other.to_table().equals(buffer.to_table())


def test_bad_groups_are_rejected_with_their_id():
    rng = np.random.default_rng(4)
    _, completions = random_group(rng, 7)
    completions[0].logprobs = completions[0].logprobs + [0.0]
    with pytest.raises(ValueError, match="group 7"):
        group_record_batch("p7", 7, completions, [0.0] * 4, [False] * 4, [0.0] * 4)
    with pytest.raises(ValueError, match="4 completions but 3 rewards"):
        group_record_batch("p7", 7, completions[1:] + completions[1:2], [0.0] * 3, [0] * 4, [0] * 4)


def test_environment_tokens_are_context_in_the_learner_batch_and_counted_apart():
    """A multi-turn row's tool-result tokens sit in `input_ids` and `attention_mask` (the
    policy reads them) but not in `response_mask` (nothing trains on them)."""
    from cagrpo_ray.rollout.batch_metrics import rollout_metrics

    rng = np.random.default_rng()  # fresh inputs every run
    completions, masks = [], []
    for _ in range(8):
        prompt = rng.integers(3, 50, size=int(rng.integers(1, 6))).tolist()
        length = int(rng.integers(1, 20))
        mine = rng.random(length) < 0.6
        mine[0] = True
        mask = None if mine.all() and rng.random() < 0.5 else mine.tolist()
        masks.append(mine if mask is not None else np.ones(length, bool))
        tokens = rng.integers(3, 50, size=length).tolist()
        logprobs = np.where(mine, -rng.random(length), 0.0).tolist()
        completions.append(Completion(prompt, tokens, logprobs, "", "stop", 0, from_policy=mask,
                                      turns=int(rng.integers(1, 4)),
                                      tool_calls=int((~mine).any()), tool_seconds=0.5))  # fmt: skip
    table = pa.Table.from_batches([group_record_batch("p", 0, completions, [0.0] * 8,
                                                      [False] * 8, [1.0] * 8)])  # fmt: skip
    batch = to_learner_batch(table, pad_token_id=0)
    for row, (c, mine) in enumerate(zip(completions, masks, strict=True)):
        p, n = len(c.prompt_token_ids), len(c.token_ids)
        assert batch["input_ids"][row, p : p + n].tolist() == c.token_ids
        assert batch["attention_mask"][row].sum() == p + n
        want = np.zeros(batch["input_ids"].shape[1], bool)
        want[p : p + n] = mine
        assert batch["response_mask"][row].numpy().tolist() == want.tolist()
    metrics = rollout_metrics(table, group_size=8, multi_turn=True)
    env_tokens = sum(int((~m).sum()) for m in masks)
    assert metrics["env/environment_token_fraction"] == pytest.approx(
        env_tokens / sum(len(c.token_ids) for c in completions)
    )
    assert metrics["env/tool_calls"] == sum(c.tool_calls for c in completions)
    assert metrics["env/turns_mean"] == pytest.approx(np.mean([c.turns for c in completions]))
    assert metrics["env/tool_seconds"] == pytest.approx(4.0)
    assert "env/turns_mean" not in rollout_metrics(table, group_size=8)


def test_a_table_of_another_schema_is_refused_whole():
    rng = np.random.default_rng(3)
    buffer = RolloutBuffer()
    buffer.add(random_group(rng, 1)[0])
    other = buffer.to_table().drop_columns(["turns"])
    with pytest.raises(ValueError, match="expected"):
        buffer.load_table(other)
    assert len(buffer) == 1  # nothing was lost to the refused table
