"""Write the examples' data sets: small GSM8K-style arithmetic word problems, generated here
(no download), in two layouts that peers' users already have.

    python examples/make_data.py [--out runs/example_data] [--train 512] [--test 64]

writes

- `<out>/verl_gsm8k/{train,test}.parquet` in verl's layout, as verl's
  `examples/data_preprocess/gsm8k.py` writes GSM8K: `data_source`, `prompt` (chat messages,
  the question followed by verl's "####" instruction), `ability`, `reward_model` (`style`,
  `ground_truth`) and `extra_info` (`split`, `index`, `answer`, `question`);
- `<out>/trl_conversational/{train,test}.parquet` in TRL's conversational layout: `prompt`
  (a system and a user message), `solution` (the answer) and `operation`, which TRL passes to
  the reward function as a keyword argument like every column but the prompt.

Each problem takes one operation on small numbers (SmolLM2-135M-Instruct answers about a
quarter of one-digit arithmetic right at temperature 0.7, so a group of samples mostly has
both right and wrong answers). Train and test hold no question in common.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# (operation, template, answer): the names and objects vary, the arithmetic is one step
TEMPLATES = [
    ("add", "{name} has {a} {things}. {pronoun} gets {b} more. How many {things} does "
     "{name} have now?", lambda a, b: a + b),
    ("subtract", "{name} had {a} {things} and gave {b} of them away. How many {things} "
     "does {name} have left?", lambda a, b: a - b),
    ("multiply", "{name} buys {a} bags with {b} {things} in each bag. How many {things} "
     "does {name} buy?", lambda a, b: a * b),
]  # fmt: skip
NAMES = [("Tom", "He"), ("Ann", "She"), ("Raj", "He"), ("Mia", "She"), ("Leo", "He"),
         ("Zoe", "She")]  # fmt: skip
THINGS = ["apples", "marbles", "stickers", "pencils", "cookies", "shells"]
VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TRL_SYSTEM = "Solve the problem step by step. End with the final answer as 'Answer: <number>'."


def problems(count: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`count` distinct problems {question, answer, operation} not in `exclude`."""
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < count:
        operation, template, solve = rng.choice(TEMPLATES)
        name, pronoun = rng.choice(NAMES)
        a, b = rng.randint(2, 9), rng.randint(1, 9)
        if operation == "subtract" and b > a:
            a, b = b, a
        question = template.format(name=name, pronoun=pronoun, a=a, b=b,
                                   things=rng.choice(THINGS))  # fmt: skip
        if question not in seen:
            seen.add(question)
            out.append({"question": question, "answer": str(solve(a, b)),
                        "operation": operation})  # fmt: skip
    return out


def verl_rows(split: str, items: list[dict]) -> list[dict]:
    return [
        {
            "data_source": "example/arith_gsm",
            "prompt": [{"role": "user", "content": f"{p['question']} {VERL_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p["answer"]},
            "extra_info": {"split": split, "index": i, "answer": p["answer"],
                           "question": p["question"]},  # fmt: skip
        }
        for i, p in enumerate(items)
    ]


def trl_rows(items: list[dict]) -> list[dict]:
    return [
        {
            "prompt": [{"role": "system", "content": TRL_SYSTEM},
                       {"role": "user", "content": p["question"]}],  # fmt: skip
            "solution": p["answer"],
            "operation": p["operation"],
        }
        for p in items
    ]


def write(out: Path, train_size: int, test_size: int, seed: int = 0) -> dict[str, Path]:
    """Write both layouts under `out`; returns layout -> its folder."""
    train = problems(train_size, seed)
    test = problems(test_size, seed + 1, exclude={p["question"] for p in train})
    folders = {"verl_gsm8k": out / "verl_gsm8k", "trl_conversational": out / "trl_conversational"}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    for split, items in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(verl_rows(split, items)),
                       folders["verl_gsm8k"] / f"{split}.parquet")  # fmt: skip
        pq.write_table(pa.Table.from_pylist(trl_rows(items)),
                       folders["trl_conversational"] / f"{split}.parquet")  # fmt: skip
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/example_data"))
    parser.add_argument("--train", type=int, default=512, help="training problems")
    parser.add_argument("--test", type=int, default=64, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for layout, folder in write(args.out, args.train, args.test, args.seed).items():
        print(f"{layout}: {folder}/train.parquet ({args.train}), test.parquet ({args.test})")


if __name__ == "__main__":
    main()
