"""A lost chunk is generated again under its own group ids, so with its own seeds
(cagrpo_ray/rollout/requeue.py, Scheduler._submit), and a checkpoint keeps those ids."""

from types import SimpleNamespace

import pytest

from cagrpo_ray.config import Config
from cagrpo_ray.rollout.requeue import PromptChunk, Requeue
from cagrpo_ray.scheduler import Scheduler

pytestmark = pytest.mark.unit


def test_chunks_wait_in_group_id_order_and_split_only_when_they_must():
    requeue = Requeue()
    requeue.push(PromptChunk((7, 8), (12, 13)))
    requeue.push(PromptChunk((3, 4), (4, 5)))
    assert requeue.take(2) == PromptChunk((3, 4), (4, 5))  # the oldest groups first
    assert requeue.take(1) == PromptChunk((7,), (12,))  # room for one: the rest waits
    assert len(requeue) == 1 and requeue.take(4) == PromptChunk((8,), (13,))
    assert not requeue


def test_the_checkpoint_keeps_group_ids_and_reads_the_old_form():
    requeue = Requeue([PromptChunk((9,), (20,))])
    state = requeue.state(pending=[PromptChunk((5, 6), (16, 17))])
    assert state == [[[5, 6], [16, 17]], [[9], [20]]]
    restored, next_id = Requeue.from_state(state, next_group_id=24)
    assert next_id == 24 and restored.state([]) == state
    # bare indices (checkpoints written before ids were kept): new ids, one group each
    restored, next_id = Requeue.from_state([3, 4], next_group_id=24)
    assert next_id == 26 and restored.state([]) == [[[3], [24]], [[4], [25]]]


class RecordingPool:
    def __init__(self):
        self.submitted = []

    def submit(self, replica, prompts, sampling, tag):
        self.submitted.append((tag, sampling.seed))


def scheduler(chunk_prompts=2) -> Scheduler:
    config = Config()
    config.rollout.prompts_per_step = 4
    config.rollout.chunk_prompts = chunk_prompts
    tokenizer = SimpleNamespace(chat_template=None, encode=lambda text, **_: [len(text)])
    source = [SimpleNamespace(question=f"q{i}", uid=f"u{i}") for i in range(100)]
    pool = RecordingPool()
    return Scheduler(config, tokenizer, source, pool, None, None, None, None, None)


def test_a_lost_chunk_is_submitted_again_with_its_own_ids_and_seed():
    s = scheduler()
    for _ in range(3):
        s._submit(replica=0, count=2)
    (lost, seed), later = s.pool.submitted[1], s.pool.submitted[2]
    s.requeue.push(lost)  # its replica died
    s._submit(replica=1, count=2)
    assert s.pool.submitted[-1] == (lost, seed)
    s._submit(replica=1, count=2)  # then new prompts, after the ones already started
    new, _ = s.pool.submitted[-1]
    assert new.group_ids == (6, 7) and new.indices == (6, 7)
    assert later[0].group_ids == (4, 5)
    # seeds come from (step, place in the step): a run without the loss draws the same ones
    clean = scheduler()
    for _ in range(4):
        clean._submit(replica=0, count=2)
    assert clean.pool.submitted[1] == (lost, seed)
    assert clean.pool.submitted[3] == s.pool.submitted[-1]
