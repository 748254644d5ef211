"""The whole system on a real pretrained LM: SmolLM2-135M-Instruct (`configs/cpu-smollm2.yaml`).

One short run, in two parts, that the checks below share. Part one is the user's command
(`python -m cagrpo_ray.run`) stopped by SIGTERM after its first step: it must finish the step,
write a checkpoint and exit cleanly. Part two resumes it in this process (`--resume`'s path)
to the last step and records, before its actors stop, the parameter digests that each vLLM
replica holds. The run uses what the toy policy never exercised: a 49,152-token BPE vocabulary,
tied input/output embeddings, the model's ChatML template and stop token, free-text answers
scored by `reasoning_gym_text`, and responses cut at `rollout.max_tokens`.

The learning rate is large for this model (1e-4, no warm-up) on purpose: one step then moves
the tied embedding far enough that a generator still sampling with the old output head would
show a log-prob mismatch far above the bound checked here (the counterfactual is computed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray
import torch

from cagrpo_ray.config import load_config
from cagrpo_ray.driver.trainer import Trainer
from cagrpo_ray.metrics.jsonl import read_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/cpu-smollm2.yaml"
STEPS = 3
MAX_TOKENS = 16  # below many of the model's answers: some responses are cut


def overrides(out: Path) -> list[str]:
    return [
        f"run.output_dir={out}",
        "run.name=smol",
        f"run.steps={STEPS}",
        "run.checkpoint_every=0",  # part one's checkpoint is the signal's, part two's the last
        "run.keep_checkpoints=4",
        "rollout.num_generators=1",  # one replica started twice; two replicas: test_train
        "rollout.prompts_per_step=2",
        "rollout.group_size=4",
        "rollout.chunk_prompts=1",
        f"rollout.max_tokens={MAX_TOKENS}",
        "algorithm.lr=1e-4",
        "algorithm.warmup_steps=0",
        # the run trains at most 6 prompts: 64, not the default 20,000, which took ~5 s to draw
        # (basic_arithmetic) and as long again to exclude from the held-out split, per start
        "data.train_size=64",
        "data.eval_size=4",
        "eval.samples=1",
        "eval.temperatures=[]",
        "metrics.port=0",
        "metrics.inspect_port=null",
        "sync.timeout_s=60",
        # vLLM eager: its engine starts in ~18 s instead of ~40-90 s (compiling), twice
        # (bench_generation_modes); the compiled engines' weight sync into two replicas of this
        # model is what the 30-step run of docs/results/smollm2_run.md measured.
        "rollout.enforce_eager=true",
    ]


class DigestTrainer(Trainer):
    """Records each vLLM replica's parameter digests when the run ends, before its actors stop."""

    digests: list = []

    def close(self):
        if self.pool is not None:
            self.pool.await_ready()
            self.digests = ray.get([g.parameter_digests.remote() for g in self.pool.actors])
            self.versions = ray.get([g.policy_version.remote() for g in self.pool.actors])
        super().close()


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory, smollm2_dir, shared_ray):
    out = tmp_path_factory.mktemp("smollm2")
    run_dir = out / "smol"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "cagrpo_ray.run", "--config", CONFIG]
    for item in overrides(out):
        cmd += ["--set", item]
    log = (out / "part1.log").open("w")
    process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None, (out / "part1.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "no step within 15 minutes"
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=600)
    log.close()
    part1 = {
        "status": status,
        "log": (out / "part1.log").read_text(),
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")),
    }
    trainer = DigestTrainer(load_config(CONFIG, overrides(out)), resume=True)
    summary = trainer.run()
    return run_dir, part1, summary, trainer


@pytest.mark.integration
def test_sigterm_checkpoints_and_resume_finishes_the_run(smollm2_run):
    run_dir, part1, summary, _ = smollm2_run
    assert part1["status"] == 128 + signal.SIGTERM, part1["log"][-4000:]  # stopped, not finished
    stopped = part1["summary"]["stopped_at"]
    assert 1 <= stopped < STEPS
    assert f"step_{stopped:06d}" in part1["checkpoints"]
    assert "eval_before" in part1["summary"]
    assert summary["final_step"] == STEPS and "stopped_at" not in summary
    assert summary["eval_before"] == part1["summary"]["eval_before"]  # kept across the resume
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # none lost, none twice


@pytest.mark.integration
def test_generators_serve_the_learners_tied_embedding_and_head(smollm2_run, smollm2_dir):
    from transformers import AutoModelForCausalLM

    from cagrpo_ray.rollout.worker_extension import tensor_digest

    run_dir, _, summary, trainer = smollm2_run
    assert trainer.versions == [STEPS] * len(trainer.versions)
    trained = AutoModelForCausalLM.from_pretrained(summary["policy_dir"], dtype=torch.float32)
    assert trained.config.tie_word_embeddings
    embedding = trained.get_input_embeddings().weight.detach()
    want = tensor_digest(embedding)
    for replica in trainer.digests:
        for worker in replica:
            tied = [
                name for name in worker if name.endswith(("embed_tokens.weight", "lm_head.weight"))
            ]
            assert tied, sorted(worker)[:8]
            for name in tied:
                assert worker[name] == want, f"vLLM's {name} is not the learner's embedding"

    # After every sync, the generators' log-probs of their samples are the learner's.
    records = read_metrics(run_dir / "metrics.jsonl")
    for r in records:
        assert r["logprob/mismatch_max"] < 1e-3, (r["step"], r["logprob/mismatch_max"])

    # The counterfactual: the trained body with the starting output head (what a generator
    # would sample with if the tied head were not reloaded) gives log-probs that differ from
    # the trained policy's by far more than that bound, on the run's own sampled tokens.
    start = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tokens = sampled_sequences(run_dir, smollm2_dir)
    with torch.no_grad():
        hidden = trained.model(input_ids=tokens).last_hidden_state
        new = torch.log_softmax(hidden @ embedding.T, -1)
        old = torch.log_softmax(hidden @ start.get_input_embeddings().weight.T, -1)
    picked = tokens[:, 1:, None]
    gap = (new[:, :-1].gather(-1, picked) - old[:, :-1].gather(-1, picked)).abs().max()
    assert gap > 1e-2, f"a stale head would differ by only {gap:.2e}: the check is not sharp"


def sampled_sequences(run_dir: Path, model_dir) -> torch.Tensor:
    """[1, L]: the prompt and the longest sampled response of the newest inspected step."""
    from transformers import AutoTokenizer

    newest = sorted((run_dir / "inspect").glob("step_*.parquet"))[-1]
    rows = pq.read_table(newest, columns=["prompt_text", "token_ids"]).to_pylist()
    row = max(rows, key=lambda r: len(r["token_ids"]))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode(row["prompt_text"], add_special_tokens=False)
    return torch.tensor([prompt + list(row["token_ids"])])


@pytest.mark.integration
def test_truncation_lengths_and_unparsed_answers_are_reported(smollm2_run):
    run_dir, _, _, _ = smollm2_run
    records = read_metrics(run_dir / "metrics.jsonl")
    assert max(r["response/length_max"] for r in records) == MAX_TOKENS
    assert any(r["response/truncated_fraction"] > 0 for r in records)
    assert all(0 < r["response/length_mean"] <= MAX_TOKENS for r in records)
    assert all(0.0 <= r["reward/unparsed_fraction"] <= 1.0 for r in records)
    # the rollouts were scored by the free-text verifier, through the real pool
    assert all("reward/mean" in r for r in records)


@pytest.mark.integration
def test_the_exported_policy_evaluates_with_the_cli(smollm2_run, smollm2_dir):
    from transformers import AutoModelForCausalLM

    run_dir, _, summary, _ = smollm2_run
    policy = Path(summary["policy_dir"])
    trained = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert not torch.equal(
        trained.get_input_embeddings().weight, start.get_input_embeddings().weight
    ), "the exported policy equals the starting one"
    assert (policy / "tokenizer.json").exists() and (policy / "chat_template.jinja").exists()
    config = load_config(CONFIG)
    out = run_dir / "eval.json"
    source = "reasoning_gym:chain_sum?seed=99000&size=4&min_terms=2&max_terms=2&max_digits=1"
    subprocess.run(
        [sys.executable, "-m", "cagrpo_ray.eval", "--model", str(policy), "--data", source,
         "--samples", "1", "--engine", "hf", "--max-tokens", "32", "--out", str(out),
         "--weights", '{"reasoning_gym_text": 1.0}', "--instruction", config.data.instruction],
        check=True, timeout=600, cwd=REPO,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["metrics"]["num_prompts"] == 4
    assert 0.0 <= result["metrics"]["pass@1"] <= 1.0
