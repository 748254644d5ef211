"""The examples of bringing one's own task (`examples/`): the data script, then each example's
`config.yaml` trained as `python -m cagrpo_ray.run --config examples/<name>/config.yaml` trains
it (its driver: `load_config`, then `Trainer.run`; the command around it is
tests/test_run_exits.py's and tests/test_smollm2_run.py's), on SmolLM2-135M-Instruct, one step
each, responses cut at 48 tokens (a step was ~48 s at the examples' 128, nearly all of it
generation: both tests took 347 s at two steps of 128 tokens, 220 s at two of 48). Both run on
the tests' Ray cluster, on one vLLM replica that the first example's run starts and the
second's takes as it is (`KeptGenerators`: the two configs start their replica alike), a
SmolLM2 start fewer. One step trains, syncs the trained weights into the replica that then
evaluates, and inspects 16 responses: everything checked here; a second step repeated it.

Each run must train without a verifier error, render the dataset's chat messages with the
model's template, log the reward function's own components, evaluate with the function, and
give every inspected response the reward that the user's function gives its text.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from cagrpo_ray.config import load_config
from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.metrics.jsonl import read_metrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
STEPS = 1
MAX_TOKENS = 48


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


@pytest.fixture(scope="module")
def example_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("example_data")
    subprocess.run(
        [sys.executable, "examples/make_data.py", "--out", str(out), "--train", "64",
         "--test", "16"],  # fmt: skip
        cwd=REPO,
        check=True,
    )
    return out


def train(example: str, data: Path, out: Path, kept) -> Path:
    overrides = [
        f"run.output_dir={out}", f"run.steps={STEPS}",
        f"data.path={data / example / 'train.parquet'}",
        f"data.eval_path={data / example / 'test.parquet'}",
        "data.eval_size=8", "metrics.port=0", "metrics.inspect_port=null",
        # responses of up to 48 tokens, not the example's 128: generation is most of a step
        # here (~35 tokens/s), and nothing checked needs a whole answer (a cut one is scored
        # by the user's function like any other)
        f"rollout.max_tokens={MAX_TOKENS}",
        "metrics.inspect_every=1", "metrics.inspect_groups=4",
    ]  # fmt: skip
    config = load_config(REPO / "examples" / example / "config.yaml", overrides)
    Trainer(config, kept_generators=kept).run()
    [run_dir] = [path for path in out.iterdir() if (path / "summary.json").exists()]
    return run_dir


def inspected_responses(run_dir: Path) -> list[dict]:
    return [
        row
        for path in sorted((run_dir / "inspect").glob("step_*.parquet"))
        for row in pq.read_table(path, columns=["prompt_uid", "prompt_text", "reward",
                                                "token_ids"]).to_pylist()  # fmt: skip
    ]


def check_run(run_dir: Path, function_name: str) -> tuple[dict, list[dict]]:
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["reward/verifier_errors"] == 0 for m in metrics)
    summary = json.loads((run_dir / "summary.json").read_text())
    for phase in ("eval_before", "eval_after"):
        assert summary[phase]["verifier_errors"] == 0
        assert summary[phase][f"mean_{function_name}"] == summary[phase]["mean_reward"]
    responses = inspected_responses(run_dir)
    assert len(responses) >= 8
    return summary, responses


def test_verl_parquet_and_compute_score_train_smollm2(example_data, tmp_path, kept_generators):
    run_dir = train("verl_gsm8k", example_data, tmp_path, kept_generators)
    summary, responses = check_run(run_dir, "gsm8k")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert all(0 <= m["reward/gsm8k/strict_format"] <= 1 for m in metrics)  # the dict's key
    compute_score = load(REPO / "examples/verl_gsm8k/reward.py", "compute_score")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "policy")
    rows = pq.read_table(example_data / "verl_gsm8k" / "train.parquet").to_pylist()
    for response in responses:
        row = rows[int(response["prompt_uid"].rpartition(":")[2])]
        # the prompt is the row's messages through the ChatML template
        assert f"<|im_start|>user\n{row['prompt'][0]['content']}<|im_end|>" in (
            response["prompt_text"]
        )
        text = tokenizer.decode(response["token_ids"], skip_special_tokens=True)
        truth = row["reward_model"]["ground_truth"]
        expected = compute_score(row["data_source"], text, truth, row["extra_info"])
        assert response["reward"] == expected["score"], text


def test_trl_conversational_dataset_and_function_train_smollm2(
    example_data, tmp_path, kept_generators
):
    run_dir = train("trl_conversational", example_data, tmp_path, kept_generators)
    summary, responses = check_run(run_dir, "accuracy")
    accuracy_reward = load(REPO / "examples/trl_conversational/reward.py", "accuracy_reward")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "policy")
    rows = pq.read_table(example_data / "trl_conversational" / "train.parquet").to_pylist()
    for response in responses:
        row = rows[int(response["prompt_uid"].rpartition(":")[2])]
        system, user = row["prompt"]
        # the dataset's own system turn, not the model's default one
        assert response["prompt_text"].startswith(
            f"<|im_start|>system\n{system['content']}<|im_end|>\n<|im_start|>user\n"
            f"{user['content']}<|im_end|>"
        )
        text = tokenizer.decode(response["token_ids"], skip_special_tokens=True)
        [expected] = accuracy_reward([[{"role": "assistant", "content": text}]],
                                     [row["solution"]], operation=[row["operation"]])  # fmt: skip
        assert response["reward"] == expected, text
