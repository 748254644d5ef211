"""Raw vLLM engine tokens/s on a fixed batch of prompts: the baseline for the system benchmark.

    .venv/bin/python benchmarks/bench_rollout_engine.py [--model DIR] [--prompts 64] [--n 8]
        [--max-tokens 64] [--repeats 5] [--eager] [--out benchmarks/results/bench_rollout_engine.md]

`fixed_prompts` and `measure_rollout` are what the whole-system benchmark reuses: it times its
generator pool's `generate` on the same prompts and sampling, and divides. Without `--model`
the engine serves the random-init small policy (`random_policy(seed=0)`), whose samples end at
eos or at `--max-tokens`; only tokens actually generated are counted. Every timed call uses the
same seed, so every call generates the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cagrpo_ray.metrics.provenance import report
from cagrpo_ray.types import Completion, SamplingConfig

Generate = Callable[[list[list[int]], SamplingConfig], list[list[Completion]]]


def fixed_prompts(tokenizer, num_prompts: int = 64, seed: int = 0) -> list[list[int]]:
    """`num_prompts` chain-sum questions ("<a>+<b>-<c>="), chat-templated when the tokenizer
    has a template; the same token ids for the same tokenizer, count and seed."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        terms = [str(rng.randint(1, 99)) for _ in range(rng.randint(2, 4))]
        signs = [rng.choice("+-") for _ in terms[1:]]
        question = terms[0] + "".join(s + t for s, t in zip(signs, terms[1:], strict=True)) + "="
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
            )
            prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
        else:
            prompts.append(tokenizer(question).input_ids)
    return prompts


@dataclass(frozen=True)
class Throughput:
    tokens: int  # completion tokens per call
    seconds: list[float]  # per timed call

    @property
    def tokens_per_s(self) -> float:
        """Median over the timed calls."""
        return self.tokens / statistics.median(self.seconds)

    @property
    def best_tokens_per_s(self) -> float:
        return self.tokens / min(self.seconds)


def measure_rollout(
    generate: Generate,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    repeats: int = 5,
    warmup: int = 1,
) -> Throughput:
    """Time `repeats` calls of `generate(prompts, sampling)` after `warmup` untimed ones."""
    for _ in range(warmup):
        generate(prompts, sampling)
    seconds, tokens = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        groups = generate(prompts, sampling)
        seconds.append(time.perf_counter() - start)
        count = sum(len(c.token_ids) for group in groups for c in group)
        if tokens is not None and count != tokens:
            raise RuntimeError(f"a seeded call generated {count} tokens, an earlier one {tokens}")
        tokens = count
    return Throughput(tokens, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF model dir (default: tiny)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eager", action="store_true", help="vLLM enforce_eager (no compile)")
    parser.add_argument("--out", type=Path, default=None, help="append the result to this file")
    args = parser.parse_args()

    from cagrpo_ray.policies import random_policy
    from cagrpo_ray.rollout.engines import make_engine

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_policy(Path(tmp) / "policy", seed=0)
        start = time.perf_counter()
        engine = make_engine("vllm", model, seed=0, max_model_len=512, enforce_eager=args.eager)
        startup = time.perf_counter() - start
        prompts = fixed_prompts(engine.tokenizer, args.prompts)
        sampling = SamplingConfig(
            n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=0
        )
        result = measure_rollout(engine.generate, prompts, sampling, repeats=args.repeats)
        engine.close()

    mode = "eager" if args.eager else "compiled"
    command = (
        f".venv/bin/python benchmarks/bench_rollout_engine.py --prompts {args.prompts} "
        f"--n {args.n} --max-tokens {args.max_tokens} --repeats {args.repeats}"
        + (" --eager" if args.eager else "")
        + (f" --model {args.model}" if args.model else "")
    )
    report(
        f"vLLM {mode}",
        [
            "model",
            "prompts x n",
            "tokens/call",
            "median s",
            "tokens/s (median)",
            "tokens/s (best)",
            "engine start s",
        ],
        [
            [
                args.model or "tiny random (1.8 M)",
                f"{args.prompts} x {args.n}",
                result.tokens,
                f"{statistics.median(result.seconds):.2f}",
                f"{result.tokens_per_s:.0f}",
                f"{result.best_tokens_per_s:.0f}",
                f"{startup:.0f}",
            ]
        ],
        out=args.out,
        command=command,
    )


if __name__ == "__main__":
    main()
