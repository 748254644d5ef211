"""Two gloo ranks on the CPU give what one process gives on the whole batch.

Rank 0 holds rows [0, 10) and rank 1 rows [10, 24) of the batch, rank 1 with its trailing
all-padding columns trimmed (T = 40 instead of 48). Each rank prepares the loss inputs over the
process group, then runs two micro-batches; its gradients must equal the single-process
full-batch gradient on its rows, and the ranks' losses must sum to the full-batch loss.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cagrpo_ray.algo.losses import (
    LOSS_AGG_MODES,
    cagrpo_token_weights,
    policy_loss,
    prepare_loss_inputs,
)

pytestmark = pytest.mark.unit

LOSSES = ("grpo", "cagrpo", "clip_cov", "kl_cov")
SPLIT = 10  # rank 0: rows [0, 10); rank 1: rows [10, 24)
RANK1_WIDTH = 40
SETTINGS = {"clip_cov_ratio": 0.03, "kl_cov_ratio": 0.03, "seed": 5}


def make_batch():
    g = torch.Generator().manual_seed(0)
    B, T = 24, 48
    old = -3 * torch.rand(B, T, generator=g) ** 2
    new = old + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.85
    mask[SPLIT:, RANK1_WIDTH:] = False
    mask[3] = False
    adv = torch.randn(B, generator=g)
    gid = torch.arange(B) // 2  # groups of 2, whole on each rank
    return new, old, adv, mask, gid


def rank_rows(rank):
    return (
        (slice(0, SPLIT), slice(None)) if rank == 0 else (slice(SPLIT, None), slice(0, RANK1_WIDTH))
    )


def run_losses(new, old, adv, mask, gid, cov_scope, micro_batches, process_group=None):
    """{(name, agg): (summed loss, gradient)} for every loss and aggregation."""
    out = {}
    for name in LOSSES:
        prepared = prepare_loss_inputs(
            name, old, adv, mask, gid, cov_scope=cov_scope, process_group=process_group, **SETTINGS
        )
        for agg in LOSS_AGG_MODES:
            logp = new.clone().requires_grad_()
            total = 0.0
            for rows in micro_batches:
                part = policy_loss(
                    name, logp[rows], old[rows], adv[rows], mask[rows], loss_agg=agg,
                    clip_eps_high=0.28, ref_logprobs=old[rows] - 0.1, kl_coef=0.1,
                    prepared=prepared.rows(rows),
                )  # fmt: skip
                part.loss.backward()
                total += part.loss.item()
            out[(name, agg, cov_scope)] = (total, logp.grad)
    return out


def worker(rank, world_size, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        rows, cols = rank_rows(rank)
        new, old, adv, mask, gid = (t[rows] for t in make_batch())
        new, old, mask = new[:, cols], old[:, cols], mask[:, cols]
        pg = dist.group.WORLD
        half = new.shape[0] // 2
        results = {"weights": cagrpo_token_weights(old, adv, mask, scope="batch", process_group=pg)}
        for scope in ("batch", "group"):
            results.update(
                run_losses(new, old, adv, mask, gid, scope, [slice(0, half), slice(half, None)], pg)
            )
        torch.save(results, result_file.format(rank))
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process(tmp_path):
    result_file = str(tmp_path / "rank{}.pt")
    mp.spawn(worker, args=(2, str(tmp_path / "init"), result_file), nprocs=2, join=True)
    ranks = [torch.load(result_file.format(r)) for r in range(2)]

    new, old, adv, mask, gid = make_batch()
    whole = cagrpo_token_weights(old, adv, mask, scope="batch")
    for rank, got in enumerate(ranks):
        rows, cols = rank_rows(rank)
        torch.testing.assert_close(got["weights"], whole[rows][:, cols], rtol=1e-5, atol=1e-6)

    single = {}
    for scope in ("batch", "group"):
        single.update(run_losses(new, old, adv, mask, gid, scope, [slice(None)]))
    for key, (loss, grad) in single.items():
        assert sum(r[key][0] for r in ranks) == pytest.approx(loss, rel=1e-5, abs=1e-7), key
        for rank, got in enumerate(ranks):
            rows, cols = rank_rows(rank)
            torch.testing.assert_close(got[key][1], grad[rows][:, cols], rtol=1e-5, atol=1e-8)
        assert grad.abs().sum() > 0, key
