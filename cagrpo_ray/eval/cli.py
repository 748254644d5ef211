"""Command line: evaluate a model directory on a prompt source, print a table, write JSON.

    python -m cagrpo_ray.eval --model <dir> --data <source> --samples <k> \\
        [--engine vllm|hf] [--out results.json]

A source is `reasoning_gym:<dataset>?seed=<s>&size=<n>[&split=eval][&exclude_train=<n>]
[&<config field>=<value>]` (other fields go to the dataset's config, e.g. `min_terms=2`; values
are read as JSON when they parse, so `2` is a number and `true` a bool), or the path of a
`.jsonl`/`.json`/`.parquet` file of problems and answers. `exclude_train=<n>` drops the first
n training prompts' questions from the eval split, as a run with `data.train_size=<n>` does for
its held-out prompts: with the run's seed and config, the source is that run's held-out split
(`--offset` and `--limit` then cut a range out of it, e.g. a test set after a validation set).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from urllib.parse import parse_qsl

SOURCE_KEYS = {"seed": int, "size": int, "split": str, "exclude_train": int}
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


def load_prompt_source(spec: str, question_column: str | None = None, answer_column="answer"):
    """The `PromptSource` that `spec` names (see the module docstring for the forms)."""
    from cagrpo_ray.data import FilePromptSource, ReasoningGymSource

    if spec.startswith("reasoning_gym:"):
        name, _, query = spec.removeprefix("reasoning_gym:").partition("?")
        if not name:
            raise ValueError(f"source {spec!r} names no dataset; e.g. reasoning_gym:chain_sum")
        options: dict = {"split": "eval"}
        config: dict = {}
        for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
            if key == "exclude_train":
                options["exclude_sizes"] = {"train": int(value)}
            elif key in SOURCE_KEYS:
                options[key] = SOURCE_KEYS[key](value)
            else:
                config[key] = _json_or_str(value)
        return ReasoningGymSource(name, config, **options)
    if spec.endswith(FILE_SUFFIXES):
        return FilePromptSource(spec, question_column=question_column, answer_column=answer_column)
    raise ValueError(
        f"source {spec!r} is neither 'reasoning_gym:<dataset>?seed=..&size=..' nor a path "
        f"ending in {', '.join(FILE_SUFFIXES)}"
    )


def _json_or_str(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def instruction_from_flag(flag: str) -> str | None:
    """'r1' -> the R1 instruction, 'none' -> None, anything else is the text itself."""
    from cagrpo_ray.data.prompts import R1_INSTRUCTION

    return {"r1": R1_INSTRUCTION, "none": None}.get(flag, flag)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cagrpo_ray.eval",
        description="Sample a policy on held-out prompts, score with the verifiers, report "
        "pass@1, pass@k, maj@k, response length and token entropy.",
    )
    parser.add_argument("--model", required=True, help="model directory (or preset/hub name)")
    parser.add_argument(
        "--data", required=True, help="reasoning_gym:<name>?seed=..&size=.. or a file"
    )
    parser.add_argument("--samples", type=int, required=True, help="samples per prompt (k)")
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--limit", type=int, help="evaluate only the first N prompts")
    parser.add_argument("--offset", type=int, default=0, help="skip the source's first N prompts")
    parser.add_argument("--max-tokens", type=int, default=256, help="response tokens")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: disabled")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--instruction", default="r1", help="'r1', 'none' or the text itself")
    parser.add_argument(
        "--weights",
        type=json.loads,
        default={"task": 1.0, "format": 0.0},
        help='verifier weights as JSON (default {"task": 1.0, "format": 0.0}: the task '
        "verifier that fits each item, and the format rate reported without weight)",
    )
    parser.add_argument("--timeout-s", type=float, default=5.0, help="per verifier call")
    parser.add_argument("--verifier-workers", type=int, default=2)
    parser.add_argument("--question-column", help="file sources: column of the problem")
    parser.add_argument("--answer-column", default="answer", help="file sources: answer column")
    parser.add_argument("--max-model-len", type=int, default=1024, help="prompt + response")
    parser.add_argument("--kv-cache-gib", type=float, help="vLLM KV cache (default: engine's)")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument(
        "--max-turns",
        type=int,
        default=1,
        help="policy turns per episode (above 1: multi-turn with --tools, as rollout.max_turns)",
    )
    parser.add_argument(
        "--tools", default="calculator", help="comma-separated tools of multi-turn episodes"
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers import AutoTokenizer

    from cagrpo_ray.eval.evaluate import evaluate, print_results
    from cagrpo_ray.policies.build import resolve_policy
    from cagrpo_ray.rewards import RewardFunction
    from cagrpo_ray.rewards.verifiers import answer_extractor
    from cagrpo_ray.rollout.engines import make_engine
    from cagrpo_ray.types import SamplingConfig

    model_path = resolve_policy(args.model)
    source = load_prompt_source(args.data, args.question_column, args.answer_column)
    items = list(source.iter_from(args.offset))[: args.limit]
    sampling = SamplingConfig(
        n=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine_options = {"seed": args.seed, "max_model_len": args.max_model_len}
    if args.kv_cache_gib is not None:
        engine_options["kv_cache_gib"] = args.kv_cache_gib
    if args.eager and args.engine == "vllm":
        engine_options["enforce_eager"] = True
    engine = make_engine(args.engine, model_path, **engine_options)
    player = engine
    if args.max_turns > 1:  # episodes with tools, played as a run's generators play them
        from cagrpo_ray.env import EpisodePlayer, ToolEnvironment

        environment = ToolEnvironment(tuple(args.tools.split(",")))
        player = EpisodePlayer(engine, environment, args.max_turns, tokenizer)
    start = time.monotonic()
    try:
        with RewardFunction(args.weights, args.timeout_s, args.verifier_workers) as reward_fn:
            metrics = evaluate(
                player,
                tokenizer,
                items,
                reward_fn,
                args.samples,
                sampling,
                instruction_from_flag(args.instruction),
                details=True,
                extract_answer=answer_extractor(args.weights),
                multi_turn=args.max_turns > 1,
            )
    finally:
        engine.close()
    metrics["eval_seconds"] = time.monotonic() - start
    per_prompt = metrics.pop("per_prompt")
    print_results(metrics, title=f"{args.model} on {args.data}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "model": str(args.model),
            "data": args.data,
            "engine": args.engine,
            "sampling": vars(sampling),
            "instruction": args.instruction,
            "max_turns": args.max_turns,
            "weights": args.weights,
            "metrics": metrics,
            "per_prompt": per_prompt,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return metrics
