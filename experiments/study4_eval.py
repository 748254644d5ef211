"""`python -m cagrpo_ray.eval` with every sample kept: the fourth round's test evaluations.

    python experiments/study4_eval.py --samples-out X.samples.jsonl.gz -- <cagrpo_ray.eval args>

Runs the package's own evaluation command (whichever `cagrpo_ray` is on the path: `study4.py`
runs it in round 3's pinned snapshot) unchanged, and writes beside its JSON one record per
sample (`sample_records`): the prompt's uid and stratum, the response's length in tokens, its
finish reason and whether the 200-token cap cut it, the answer the task verifier read and how
it found it (`extract_answer_text`: tag, boxed, marker, last_number, or none), its reward and
verdict, and the response text. Round 3 kept per-prompt counts only, so which responses were
cut, and whether those scored, could not be read back.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import json
import sys
from pathlib import Path


def stratum(metadata: dict) -> str | None:
    """The prompt's stratum: the second split's rows name it; round 3's items have their
    expression, whose form gives it (`study4_plan.coarse_form`)."""
    from study4_plan import coarse_form, form

    if metadata.get("stratum"):
        return metadata["stratum"]
    expression = metadata.get("expression")
    return coarse_form(form(expression)) if expression else None


def sample_records(items, groups, results, max_tokens: int) -> list[dict]:
    """One record per sample, in prompt order then sample order.

    Args:
        items: the evaluated `PromptItem`s.
        groups: the engine's completions, one list of n per item (`Completion`: text,
            token_ids, finish_reason).
        results: the reward function's results, one per completion in that order (`reward`,
            `correct`).
        max_tokens: the response cap; a response cut there has finish reason "length".
    """
    from cagrpo_ray.rewards.extract import extract_answer_text

    records, row = [], 0
    for item, group in zip(items, groups, strict=True):
        for index, completion in enumerate(group):
            answer, found_by = extract_answer_text(completion.text)
            result = results[row]
            row += 1
            records.append({
                "uid": item.uid, "sample": index,
                "stratum": stratum(item.metadata or {}),
                "response_tokens": len(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "truncated": completion.finish_reason == "length",
                "max_tokens": max_tokens, "answer": answer, "found_by": found_by,
                "reward": float(result.reward), "correct": bool(result.correct),
                "response": completion.text,
            })  # fmt: skip
    if row != len(results):
        raise ValueError(f"{len(results)} results for {row} completions")
    return records


def recording(evaluate, kept: list[dict]):
    """`evaluate` (cagrpo_ray.eval.evaluate.evaluate) that also appends every sample's record
    to `kept`: the engine's and the reward function's outputs are captured on their way in."""

    def wrapped(engine, tokenizer, items, reward_fn, samples, sampling, *args, **kwargs):
        seen: dict = {}

        class Engine:
            def generate(self, prompts, sampling_):
                seen["groups"] = engine.generate(prompts, sampling_)
                return seen["groups"]

        def score(texts, scored_items):
            seen["results"] = reward_fn(texts, scored_items)
            return seen["results"]

        items = list(items)
        metrics = evaluate(Engine(), tokenizer, items, score, samples, sampling, *args, **kwargs)
        kept.extend(sample_records(items, seen["groups"], seen["results"], sampling.max_tokens))
        return metrics

    return wrapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples-out", type=Path, required=True, help=".jsonl.gz to write")
    parser.add_argument("eval_args", nargs=argparse.REMAINDER, help="-- then the eval's args")
    args = parser.parse_args(argv)
    eval_args = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args
    # the module itself: `import cagrpo_ray.eval.evaluate as module` would bind the function
    # that the package's __init__ re-exports under the same name
    module = importlib.import_module("cagrpo_ray.eval.evaluate")
    from cagrpo_ray.eval import cli

    print(f"[study4_eval] cagrpo_ray from {Path(module.__file__).parents[1]}", flush=True)
    kept: list[dict] = []
    module.evaluate = recording(module.evaluate, kept)  # cli.main imports it at call time
    cli.main(eval_args)
    if not kept:
        raise SystemExit("the evaluation kept no samples")
    args.samples_out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.samples_out.with_name(args.samples_out.name + ".tmp")
    with gzip.open(tmp, "wt") as handle:
        for record in kept:
            handle.write(json.dumps(record) + "\n")
    tmp.rename(args.samples_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
