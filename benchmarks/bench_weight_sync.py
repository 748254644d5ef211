"""Weight-sync seconds against model bytes, next to a same-process memcpy of those bytes.

    .venv/bin/python benchmarks/bench_weight_sync.py [--sizes tiny,10m,50m] [--generators 1]
        [--targets hf,vllm] [--repeats 5] [--out benchmarks/results/bench_weight_sync.md]

For each policy size, this process plays learner rank 0 (a `WeightSender` holding a float32
policy) and syncs it, version after version, into `--generators` generators of one kind:

- `hf`: HF engines, each in its own process (the bytes travel and are copied into the model);
- `vllm`: live vLLM engines (the bytes travel and vLLM's in-place reload rebuilds every layer,
  on the CPU including the repacking of the GEMM weights).

A sync's time is `WeightSender.send` from its start until every generator has confirmed
loading. The baseline is `Tensor.copy_` of every parameter into a same-shaped tensor in this
process: the cheapest way the same bytes could move at all. A third pair of columns gives the
transport floor: one gloo broadcast of a flat buffer of the same bytes to one peer process,
with no packing and no loading, beside a memcpy of one flat buffer. One baseline copy is timed right
before each sync, so that both see the same load from other processes, and the table gives the
best of `--repeats` (after a warm-up) for each, since on a shared machine the best run is the
one least disturbed; the medians are printed beside them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from cagrpo_ray.metrics.provenance import report
from cagrpo_ray.policies.model import PolicySize, new_policy, random_policy
from cagrpo_ray.sync import WeightSender
from cagrpo_ray.sync.group import join_group, open_store, start_broadcast, wait

SIZES = {  # PolicySize overrides; parameter counts in the table
    "tiny": {},
    "10m": dict(hidden_size=384, num_layers=5, num_heads=6, intermediate_size=1152),
    "50m": dict(hidden_size=768, num_layers=7, num_heads=12, intermediate_size=2304),
}


class Memcpy:
    """Copies every parameter into a same-shaped tensor; `once()` times one pass."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.sources = [t.detach() for t in tensors]
        self.targets = [t.detach().clone() for t in tensors]

    def once(self) -> float:
        start = time.perf_counter()
        for dst, src in zip(self.targets, self.sources, strict=True):
            dst.copy_(src)
        return time.perf_counter() - start


def _broadcast_peer(port: int, nbytes: int, count: int) -> None:
    store = open_store("127.0.0.1", port, 2, is_master=False, timeout_s=120)
    group = join_group(store, 1, 2, "gloo", 120, "127.0.0.1")
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(count):
        wait(start_broadcast(group, buffer, 120), 120)


def raw_broadcast_seconds(nbytes: int, repeats: int) -> tuple[list[float], list[float]]:
    """The transport floor: gloo broadcasts of one flat `nbytes` buffer to one peer process
    (no packing, no loading), each after a memcpy of the same bytes timed beside it."""
    store = open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=120)
    ctx = multiprocessing.get_context("spawn")
    peer = ctx.Process(target=_broadcast_peer, args=(store.port, nbytes, repeats + 1))
    peer.start()
    group = join_group(store, 0, 2, "gloo", 120, "127.0.0.1")
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    broadcasts, copies = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source)
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        wait(start_broadcast(group, source, 120), 120)
        broadcasts.append(time.perf_counter() - start)
    peer.join()
    return broadcasts[1:], copies[1:]


def _hf_generator(model_dir: str, address, rank: int, versions: list[int]) -> None:
    from cagrpo_ray.rollout.engines import make_engine

    engine = make_engine("hf", model_dir)
    engine.init_weight_sync(address, rank)
    for version in versions:
        engine.receive_weights(version)


def sync_seconds(target, model_dir, learner, generators, repeats, bucket_mb, timeout_s=120.0):
    """(send() seconds, memcpy seconds timed just before each send), `repeats` of each after
    one warm-up."""
    versions = list(range(1, repeats + 2))
    memcpy = Memcpy(list(learner.parameters()))
    memcpy_times = []

    def send(version: int) -> float:
        memcpy_times.append(memcpy.once())
        return sender.send(learner.named_parameters(), version).seconds

    sender = WeightSender(world_size=1 + generators, timeout_s=timeout_s, bucket_mb=bucket_mb)
    if target == "hf":
        ctx = multiprocessing.get_context("spawn")
        workers = [
            ctx.Process(target=_hf_generator, args=(str(model_dir), sender.address, r, versions))
            for r in range(1, generators + 1)
        ]
        for w in workers:
            w.start()
        sender.wait_joined()
        times = [send(v) for v in versions]
        for w in workers:
            w.join()
    else:
        from cagrpo_ray.rollout.engines import make_engine

        engines = [
            make_engine("vllm", model_dir, max_model_len=256, kv_cache_gib=1, enforce_eager=True)
            for _ in range(generators)
        ]
        joins = [
            threading.Thread(target=e.init_weight_sync, args=(sender.address, 1 + i))
            for i, e in enumerate(engines)
        ]
        for t in joins:
            t.start()
        sender.wait_joined()
        for t in joins:
            t.join()
        times = []
        for version in versions:
            receivers = [
                threading.Thread(target=e.receive_weights, args=(version,)) for e in engines
            ]
            for t in receivers:
                t.start()
            times.append(send(version))
            for t in receivers:
                t.join()
        for e in engines:
            e.close()
    sender.close()
    return times[1:], memcpy_times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,10m,50m")
    parser.add_argument("--targets", default="hf,vllm")
    parser.add_argument("--generators", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=None, help="append the table to this file")
    args = parser.parse_args()
    targets = args.targets.split(",")

    header = ["size", "params", "MB", "memcpy ms (floor run)", "gloo bcast ms", "bcast / memcpy"]
    for target in targets:
        header += [f"memcpy ms ({target} run)", f"sync→{target} ms", f"{target} / memcpy"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size_name in args.sizes.split(","):
            size = SIZES[size_name]
            model_dir = random_policy(Path(tmp) / size_name, seed=0, **size)
            learner, _ = new_policy(seed=1, size=PolicySize(**size))
            params = list(learner.parameters())
            nbytes = sum(p.numel() * p.element_size() for p in params)
            row = [
                size_name,
                f"{sum(p.numel() for p in params) / 1e6:.2f} M",
                f"{nbytes / 2**20:.1f}",
            ]
            broadcasts, copies = raw_broadcast_seconds(nbytes, args.repeats)
            row += [
                f"{min(copies) * 1e3:.1f}",
                f"{min(broadcasts) * 1e3:.1f}",
                f"{min(broadcasts) / min(copies):.1f}x",
            ]
            for target in targets:
                syncs, copies = sync_seconds(
                    target, model_dir, learner, args.generators, args.repeats, args.bucket_mb
                )
                row += [
                    f"{min(copies) * 1e3:.1f}",
                    f"{min(syncs) * 1e3:.1f}",
                    f"{min(syncs) / min(copies):.1f}x",
                ]
                print(
                    f"{size_name} {target}: sync median {statistics.median(syncs) * 1e3:.1f} ms,"
                    f" memcpy median {statistics.median(copies) * 1e3:.1f} ms",
                    flush=True,
                )
            rows.append(row)
            print(" | ".join(row), flush=True)

    report(
        f"{args.generators} generator(s)",
        header,
        rows,
        out=args.out,
        notes=[f"Best of {args.repeats} after a warm-up, in milliseconds."],
        command=f".venv/bin/python benchmarks/bench_weight_sync.py --sizes {args.sizes} "
        f"--targets {args.targets} --generators {args.generators} --repeats {args.repeats} "
        f"--bucket-mb {args.bucket_mb:g}",
    )


if __name__ == "__main__":
    main()
