"""Rollout tokens/s through the whole system vs the raw vLLM engine on the same prompts.

    .venv/bin/python benchmarks/bench_system_rollout.py [--model DIR] [--prompts 64] [--n 8]
        [--max-tokens 64] [--repeats 5] [--out benchmarks/results/bench_system_rollout.md]

"Raw": one `VLLMEngine` in this process, one `generate` call on all prompts (vLLM's async
engine batches them all). "System": the same engine inside a Ray `GeneratorActor`, fed
through the `GeneratorPool` in chunks of `--chunk` prompts (the trainer's path: Ray task
submission, pickling of prompts and completions, chunk scheduling), with every chunk in flight
at once (the default) and, for comparison, one chunk per replica at a time (the earlier
behaviour: `rollout.max_prompts_in_flight` = the chunk). The system's share of the raw
engine's tokens/s with one replica is the number to watch (target: at least 0.95). The
two-replica row shows what a second replica buys on this machine. Engines run one at a time
so that they do not compete for the cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout_engine import fixed_prompts, measure_rollout  # noqa: E402

from cagrpo_ray.metrics.provenance import report  # noqa: E402
from cagrpo_ray.types import SamplingConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: tiny)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=16, help="prompts per pool request")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from cagrpo_ray.policies import random_policy
    from cagrpo_ray.rollout.engines import make_engine
    from cagrpo_ray.rollout.generator import GeneratorActor
    from cagrpo_ray.rollout.pool import GeneratorPool

    tmp = tempfile.TemporaryDirectory()
    model = str(args.model or random_policy(Path(tmp.name) / "policy", seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = fixed_prompts(tokenizer, args.prompts)
    sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, seed=0)
    options = dict(seed=0, max_model_len=512)

    engine = make_engine("vllm", model, **options)
    raw = measure_rollout(engine.generate, prompts, sampling, args.repeats)
    engine.close()
    del engine

    rows = [("raw engine, in process", raw, 1.0)]
    ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False)
    variants = [(1, 0), (1, args.chunk), (2, 0)]  # (replicas, max prompts in flight; 0: all)
    for replicas, in_flight in variants:
        actors = [
            GeneratorActor.options(
                num_cpus=0.5,
                runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": str(r % os.cpu_count())}},
            ).remote(r, "vllm", model, options)
            for r in range(replicas)
        ]
        ray.get([a.ready.remote() for a in actors])
        pool = GeneratorPool(actors, chunk_prompts=args.chunk, max_prompts_in_flight=in_flight)
        system = measure_rollout(pool.generate, prompts, sampling, args.repeats)
        if system.tokens != raw.tokens:
            # Per-chunk seeds differ from the raw call's per-prompt seeds, so counts may differ.
            print(f"note: system generated {system.tokens} tokens per call, raw {raw.tokens}")
        flight = "all chunks in flight" if in_flight == 0 else "one chunk at a time"
        rows.append(
            (
                f"system, {replicas} replica(s), chunks of {args.chunk}, {flight}",
                system,
                system.tokens_per_s / raw.tokens_per_s,
            )
        )
        for actor in actors:
            ray.kill(actor)
    ray.shutdown()

    report(
        "Rollout through the system vs the raw engine",
        ["path", "tokens/call", "median s", "tokens/s (median)", "this / raw"],
        [
            [
                name,
                result.tokens,
                f"{result.tokens / result.tokens_per_s:.2f}",
                f"{result.tokens_per_s:.0f}",
                f"{ratio:.2f}",
            ]
            for name, result, ratio in rows
        ],
        out=args.out,
        command=f".venv/bin/python benchmarks/bench_system_rollout.py --prompts {args.prompts} "
        f"--n {args.n} --max-tokens {args.max_tokens} --chunk {args.chunk} "
        f"--repeats {args.repeats}" + (f" --model {args.model}" if args.model else ""),
    )


if __name__ == "__main__":
    main()
