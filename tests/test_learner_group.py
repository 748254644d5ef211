"""LearnerGroup: two data-parallel ranks on Ray give the update of one rank on the whole batch.

ZeRO stages 0, 2 and 3 each run two learner actors on a local 2-CPU Ray cluster; each result is
compared with one in-process rank on the whole batch, and the ranks with each other.
"""

from __future__ import annotations

import os
import time

import deepspeed
import numpy as np
import pytest
import ray
import torch
from test_learner import TINY, free_port, random_batch

from cagrpo_ray.algo import LossSpec
from cagrpo_ray.learner.group import LearnerGroup, LearnerGroupError, split_by_groups
from cagrpo_ray.learner.learner import Learner
from cagrpo_ray.learner.settings import LearnerSettings
from cagrpo_ray.policies.model import random_policy

# deadlines of seconds: `make test` runs these unit tests in the foreground, not at nice 19
pytestmark = pytest.mark.clock

LEARNER = dict(lr=1e-3, warmup_steps=0, micro_batch_size=5)
LOSS = LossSpec("cagrpo", cov_scope="batch")


@pytest.mark.unit
def test_split_keeps_groups_whole_and_balances_tokens():
    # Fresh random batches each run (the seed is in the message): 2 to 4 shards, 2 to 13
    # groups of 1 to 8 rows, responses of 1 to 40 tokens.
    seed = int(np.random.SeedSequence().entropy % 2**31)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        shards_wanted = int(rng.integers(2, 5))
        groups, size = int(rng.integers(shards_wanted, 14)), int(rng.integers(1, 9))
        batch = random_batch(
            groups, size, width=int(rng.integers(10, 48)), seed=int(rng.integers(2**31))
        )
        shards = split_by_groups(batch, shards_wanted)
        where = f"seed {seed}: {groups} groups of {size} into {shards_wanted}"

        # each shard: as many groups as an even split by count, whole, in batch order
        wanted = [len(part) for part in np.array_split(np.arange(groups), shards_wanted)]
        held = [torch.unique_consecutive(s["group_ids"]).tolist() for s in shards]
        assert [len(h) for h in held] == wanted, where
        assert sorted(g for h in held for g in h) == list(range(groups)), where
        for shard, ids in zip(shards, held, strict=True):
            assert ids == sorted(ids), where
            rows = torch.isin(batch["group_ids"], torch.tensor(ids))
            for key, value in batch.items():
                assert torch.equal(shard[key], value[rows]), (where, key)

        # by count: the same numbers of groups, consecutive, the batch cut in order
        by_count = split_by_groups(batch, shards_wanted, by="count")
        held_by_count = [torch.unique_consecutive(s["group_ids"]).tolist() for s in by_count]
        assert [len(h) for h in held_by_count] == wanted, where
        for key, value in batch.items():
            assert torch.equal(torch.cat([s[key] for s in by_count]), value), (where, key)

        # tokens: the shards differ by at most one group's
        per_group = [
            int(batch["attention_mask"][batch["group_ids"] == g].sum()) for g in range(groups)
        ]
        loads = [sum(per_group[g] for g in h) for h in held]
        assert max(loads) - min(loads) <= max(per_group), (where, loads, per_group)

    # By hand: groups of 120, 100, 20 and 20 tokens. Split by count, the shards would hold
    # groups 0-1 and 2-3 (220 and 40 tokens); balanced: 0 to the first, 1 and 2 to the second
    # (the lighter), 3 to the first (the second is full): 140 and 120.
    batch = random_batch(num_groups=4, group_size=2, width=64, seed=1)
    for row, length in enumerate([60, 60, 50, 50, 10, 10, 10, 10]):
        batch["attention_mask"][row] = (torch.arange(64) < length).long()
    shards = split_by_groups(batch, 2)
    assert [torch.unique_consecutive(s["group_ids"]).tolist() for s in shards] == [[0, 3], [1, 2]]
    assert [int(s["attention_mask"].sum()) for s in shards] == [140, 120]
    assert [torch.unique_consecutive(s["group_ids"]).tolist() for s in
            split_by_groups(batch, 2, by="count")] == [[0, 1], [2, 3]]  # fmt: skip
    with pytest.raises(ValueError, match="fewer than the 6 learner ranks"):
        split_by_groups(random_batch(num_groups=5, group_size=3), 6)
    with pytest.raises(ValueError, match="choose one of"):
        split_by_groups(batch, 2, by="length")


@pytest.fixture(scope="module")
def policy_path(tmp_path_factory):
    return random_policy(tmp_path_factory.mktemp("policy"), seed=0, **TINY)


@pytest.fixture(scope="module")
def batch():
    # Shards of 16 rows with micro-batches of 5: uneven micro-batches on both ranks.
    return random_batch(num_groups=8, group_size=4, seed=3)


@pytest.fixture(scope="module")
def one_rank_result(policy_path, batch):
    # Rank 0 of 1 in the test process (reusing the group of test_learner.py if it ran first).
    learner = Learner(
        LearnerSettings(str(policy_path), zero_stage=0, **LEARNER),
        LOSS,
        rank=0,
        world_size=1,
        master_port=free_port(),
    )
    return learner.train_step(batch), learner.state_dict_for_sync()


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():  # another module's cluster: use it, leave it running
        yield
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_match_one_rank(zero_stage, policy_path, batch, one_rank_result, local_ray):
    metrics_one, params_one = one_rank_result
    group = LearnerGroup(
        2, LearnerSettings(str(policy_path), zero_stage=zero_stage, **LEARNER), LOSS, 0.5
    )
    try:
        metrics = group.train_step(batch)
        assert metrics["learner/tokens"] == metrics_one["learner/tokens"]
        assert metrics["loss/total"] == pytest.approx(metrics_one["loss/total"], rel=1e-5)
        assert metrics["grad_norm"] == pytest.approx(metrics_one["grad_norm"], rel=1e-5)
        assert metrics["cagrpo/weight_min"] == pytest.approx(
            metrics_one["cagrpo/weight_min"], rel=1e-3, abs=1e-9
        )

        # the weights a sync sends, from rank 0 (every rank takes part in ZeRO-3's gathers)
        synced = group.foreach_learner(Learner.state_dict_for_sync)[0]
        assert synced.keys() == params_one.keys()
        for name, value in synced.items():
            # Adam moves each element by about lr * sign(g); where |g| is near Adam's eps the
            # step depends on the gradient's last bits, which the order of the micro-batch sums
            # (length-sorted, per rank) changes: a few elements may differ by a fraction of lr.
            torch.testing.assert_close(value, params_one[name], rtol=0, atol=0.05 * LEARNER["lr"])

        def full_parameters(learner: Learner) -> dict[str, torch.Tensor]:
            """Every parameter, whole, on every rank (gathered under ZeRO-3)."""
            out = {}
            for name, param in learner.engine.module.policy.named_parameters():
                with deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3):
                    out[name] = param.detach().clone()
            return out

        rank0, rank1 = group.foreach_learner(full_parameters)
        for name, value in rank0.items():
            assert torch.equal(value, rank1[name]), name
            assert torch.equal(value, synced[name]), name

        if zero_stage == 3:
            # A rank that dies takes the group down with a clear error, not a hang.
            ray.kill(group.actors[1], no_restart=True)
            with pytest.raises(LearnerGroupError, match="learner rank 1 died during train_step"):
                group.train_step(batch)
    finally:
        group.shutdown()


def fake_group(num_ranks: int) -> LearnerGroup:
    """A `LearnerGroup` (only its calls are exercised) over stand-ins for `LearnerActor`s:
    in a call, each waits `delay` seconds, then returns, raises as a survivor's collective
    does when its peer's process is gone, raises a plain error, dies, or hangs as a
    survivor's collective does when its peer raised. (Defined here, so that Ray's workers
    get the class by value: they cannot import a test module.)"""

    class FakeRank:
        def call(self, behaviour: str, delay: float = 0.0) -> str:
            time.sleep(delay)
            if behaviour == "peer closed":
                raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")
            if behaviour == "bug":
                raise ValueError("a bad batch")
            if behaviour == "die":
                os._exit(1)
            if behaviour == "hang":
                time.sleep(3600)
            return behaviour

        def alive(self) -> bool:
            return True

    group = LearnerGroup.__new__(LearnerGroup)
    group.actors = [ray.remote(max_restarts=0)(FakeRank).remote() for _ in range(num_ranks)]
    group.log_files = [None] * num_ranks
    ray.get([actor.alive.remote() for actor in group.actors])
    return group


@pytest.mark.integration
def test_a_killed_rank_is_named_lost_even_when_its_partners_error_first(local_ray):
    group = fake_group(2)
    actors = group.actors
    # rank 0's collective fails at once; rank 1's process dies a second later
    refs = [actors[0].call.remote("peer closed"), actors[1].call.remote("die", 1.0)]
    with pytest.raises(LearnerGroupError, match="learner rank 1 died during train_step") as err:
        group.collect(refs, "train_step")
    assert err.value.lost and err.value.rank == 1
    assert group.actors == []  # every rank was stopped


@pytest.mark.integration
def test_a_rank_that_raised_stops_its_hanging_partners_and_is_not_lost(local_ray, monkeypatch):
    import cagrpo_ray.learner.group as group_module

    monkeypatch.setattr(group_module, "DEATH_REPORT_S", 2.0)
    group = fake_group(2)
    partner = group.actors[1]
    refs = [group.actors[0].call.remote("bug"), partner.call.remote("hang")]
    started = time.monotonic()
    with pytest.raises(LearnerGroupError, match="learner rank 0 failed during sync") as err:
        group.collect(refs, "sync")
    assert not err.value.lost and err.value.rank == 0
    assert time.monotonic() - started < 30  # bounded: the hanging partner is not waited for
    with pytest.raises(ray.exceptions.RayActorError):  # it was stopped
        ray.get(partner.alive.remote(), timeout=60)
