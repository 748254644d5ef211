"""Forward + backward time of the CA-GRPO loss against the GRPO loss on the CPU.

    .venv/bin/python benchmarks/bench_losses.py [--batch 256] [--length 1024] [--repeats 41]

A batch of B responses of up to T tokens (random lengths, right-padded, bool mask). Each
measurement is one optimizer step's worth of loss work on the whole batch:

    prepare_loss_inputs(...)          once per batch (CA-GRPO: the kernel weights)
    policy_loss(...).loss.backward()  forward and backward of the loss

The two losses are timed alternately (so that load from other processes hits both alike),
after warm-up, and the median is reported. Diagnostics (the covariance table, which sorts every
token) are off here and timed on their own line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cagrpo_ray.algo.losses import policy_loss, prepare_loss_inputs


def make_batch(B: int, T: int, group_size: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 8, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool, right-padded
    old = torch.where(mask, -3 * torch.rand(B, T, generator=g) ** 2, 0.0)
    new = old + 0.05 * torch.randn(B, T, generator=g)
    rewards = (torch.rand(B, generator=g) < 0.5).float().view(-1, group_size)
    adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    return new, old, adv.view(-1), mask, torch.arange(B) // group_size


def step(name, new, old, adv, mask, gid, diagnostics=False, prepared=None):
    logp = new.detach().requires_grad_()
    if prepared is None:
        prepared = prepare_loss_inputs(name, old, adv, mask, gid, diagnostics=diagnostics)
    policy_loss(name, logp, old, adv, mask, prepared=prepared).loss.backward()


def timed(fn) -> float:
    """CPU seconds of this thread (torch runs single-threaded here): waiting for a core that
    another process holds is not counted, so a busy machine skews the numbers less."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    batch = make_batch(args.batch, args.length)
    cagrpo_prepared = prepare_loss_inputs("cagrpo", *batch[1:], diagnostics=False)
    cases = {
        "grpo": lambda: step("grpo", *batch),
        "cagrpo": lambda: step("cagrpo", *batch),
        "cagrpo, weights precomputed": lambda: step("cagrpo", *batch, prepared=cagrpo_prepared),
        "cagrpo + diagnostics": lambda: step("cagrpo", *batch, diagnostics=True),
    }
    for fn in cases.values():  # warm-up
        for _ in range(3):
            fn()
    times = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn))

    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    best = {name: min(t) * 1e3 for name, t in times.items()}
    tokens = int(batch[3].sum())
    print(f"B={args.batch} T={args.length} ({tokens} valid tokens), {args.threads} thread(s), "
          f"{args.repeats} repeats, CPU time of this thread")  # fmt: skip
    print(f"{'prepare + forward + backward':32s} {'median ms':>10s} {'x grpo':>7s} "
          f"{'min ms':>8s} {'x grpo':>7s}")  # fmt: skip
    for name in cases:
        print(f"{name:32s} {median[name]:10.2f} {median[name] / median['grpo']:7.2f} "
              f"{best[name]:8.2f} {best[name] / best['grpo']:7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
