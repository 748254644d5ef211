"""A lost chunk is generated again under its own group ids, so with its own seeds
(cagrpo_ray/rollout/requeue.py; how the schedule starts it again: tests/test_schedule.py), and
a checkpoint keeps those ids."""

import pytest

from cagrpo_ray.rollout.requeue import PromptChunk, Requeue

pytestmark = pytest.mark.unit


def test_chunks_wait_in_group_id_order_and_split_only_when_they_must():
    requeue = Requeue()
    requeue.push(PromptChunk((7, 8), (12, 13)))
    requeue.push(PromptChunk((3, 4), (4, 5)))
    assert requeue.take(2) == PromptChunk((3, 4), (4, 5))  # the oldest groups first
    assert requeue.take(1) == PromptChunk((7,), (12,))  # room for one: the rest waits
    assert len(requeue) == 1 and requeue.take(4) == PromptChunk((8,), (13,))
    assert not requeue


def test_the_checkpoint_keeps_group_ids():
    requeue = Requeue([PromptChunk((9,), (20,))])
    state = requeue.state(pending=[PromptChunk((5, 6), (16, 17))])
    assert state == [[[5, 6], [16, 17]], [[9], [20]]]
    assert Requeue.from_state(state).state([]) == state
