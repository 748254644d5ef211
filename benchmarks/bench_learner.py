"""One learner rank's step on the default config, against the plain-torch floor, side by side.

    .venv/bin/python benchmarks/bench_learner.py [--steps 7] [--before DIR] [--out FILE]

What a rank of the default run trains on: 64 responses of the built-in policy (16 prompts x 8
responses over 2 ranks), prompts of ~22 tokens and responses of 10-45 (mean ~27), right-padded;
one torch thread (the default layout runs two ranks of one thread each on the 2 cores). Each
variant runs in its own process, one after the other, and reports the median of `--steps`
steps after two warm-up steps:

- floor: a plain-torch forward + backward of the policy on the same number of tokens without
  padding (64 x 48), and the forward alone: what a learner step cannot beat;
- the learner as it is (fused proximal pass, no attention mask for right-padded rows), with the
  default's micro-batch of 64 and with 32 (two micro-batches: a separate proximal pass);
- `--before DIR`: the learner of another checkout (e.g. a worktree of commit ebb9699), for the
  same batch, to measure a change.

Another policy and shape: `--model` (a built-in name or a directory), `--rows`, `--prompt A:B`
and `--response A:B` (token lengths drawn uniformly from [A, B)), `--threads`, `--micro`,
`--checkpointing` and `--chunk-mib` (the learner's logits chunk). SmolLM2-135M-Instruct as a
rank of configs/cpu-smollm2.yaml trains it (16 responses, ~70-token prompts, responses up to 200
tokens, gradient checkpointing, 256 MiB chunks):

    .venv/bin/python benchmarks/bench_learner.py --model smollm2-135m-instruct --rows 16 \
        --prompt 66:75 --response 30:171 --micro 16 --checkpointing --chunk-mib 256 \
        --threads 2 --steps 2

The floor then also runs with Hugging Face's gradient checkpointing (what the learner's
recomputation costs by itself), and the learner also without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from cagrpo_ray.metrics.provenance import report  # noqa: E402

GROUP = 8


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one rank trains on, and how."""

    model: str = "chain_sum"
    rows: int = 64
    prompt: tuple[int, int] = (20, 25)  # token lengths drawn from [a, b)
    response: tuple[int, int] = (10, 46)
    micro: int = 64
    checkpointing: bool = False
    chunk_mib: float = 1024.0

    @property
    def floor_width(self) -> int:
        """The mean row length: the floor trains rows x this many tokens, unpadded."""
        return round((sum(self.prompt) + sum(self.response) - 2) / 2)


def batch(shape: Shape, seed: int = 0):
    """A rank's learner batch of `shape` (keys of both learner APIs)."""
    import torch

    from cagrpo_ray.algo.advantages import group_advantages

    g = torch.Generator().manual_seed(seed)
    rows = shape.rows
    prompt = torch.randint(*shape.prompt, (rows,), generator=g)
    response = torch.randint(*shape.response, (rows,), generator=g)
    width = int((prompt + response).max())
    columns = torch.arange(width)
    attention = (columns < (prompt + response)[:, None]).long()
    response_mask = (columns >= prompt[:, None]) & attention.bool()
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    return {
        "input_ids": torch.randint(3, 17, (rows, width), generator=g) * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
        "behavior_logprobs": -torch.rand(rows, width, generator=g) * response_mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, GROUP),
        "group_ids": torch.arange(rows // GROUP).repeat_interleave(GROUP),
        "policy_version": torch.zeros(rows, dtype=torch.long),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, steps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_floor(steps: int, shape: Shape) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from cagrpo_ray.policies.build import resolve_policy

    model = AutoModelForCausalLM.from_pretrained(resolve_policy(shape.model)).train()
    width = shape.floor_width
    ids = torch.randint(3, 17, (shape.rows, width), generator=torch.Generator().manual_seed(0))
    tokens = f"{shape.rows} x {width} unpadded"

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).mean().backward()

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    result = {f"floor: forward + backward, {tokens}": timed(forward_backward, steps)}
    if shape.checkpointing:
        model.gradient_checkpointing_enable()
        key = f"floor: forward + backward, {tokens}, gradient checkpointing"
        result[key] = timed(forward_backward, steps)
        model.gradient_checkpointing_disable()
    result[f"floor: forward, {tokens}"] = timed(forward, steps)
    return result


def run_learner(steps: int, shape: Shape, threads: int) -> dict:
    """The learner of whichever checkout is first on sys.path (either API)."""
    from cagrpo_ray.policies.build import resolve_policy

    path = resolve_policy(shape.model)
    rank = dict(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    longest = shape.response[1] - 1
    try:
        from cagrpo_ray.algo import LossSpec
        from cagrpo_ray.learner.learner import Learner
        from cagrpo_ray.learner.settings import LearnerSettings

        settings = LearnerSettings(path, zero_stage=2, lr=1e-5, micro_batch_size=shape.micro,
                                   max_response_length=longest, warmup_steps=5,
                                   gradient_checkpointing=shape.checkpointing,
                                   logits_chunk_mib=shape.chunk_mib,
                                   num_threads=threads)  # fmt: skip
        learner = Learner(settings, LossSpec("cagrpo"), **rank)
    except ImportError:  # an older checkout: keyword arguments
        from cagrpo_ray.learner.learner import Learner

        learner = Learner(path, **rank, zero_stage=2, lr=1e-5, micro_batch_size=shape.micro,
                          policy_loss="cagrpo", max_response_length=longest,
                          warmup_steps=5)  # fmt: skip
    data = batch(shape)
    return {"step": timed(lambda: learner.train_step(data), steps)}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    shape = Shape(**json.loads(args.shape))
    if args.variant == "floor":
        result = run_floor(args.steps, shape)
    else:
        result = run_learner(args.steps, shape, args.threads)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(variant: str, steps: int, shape: Shape, threads: int, tree: Path = ROOT) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, __file__, "--child", variant, "--steps", str(steps),
               "--threads", str(threads),
               "--shape", json.dumps(dataclasses.asdict(shape))]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def span(text: str) -> tuple[int, int]:
    a, b = text.split(":")
    return int(a), int(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another checkout's root, to compare")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="chain_sum", help="built-in name or HF directory")
    parser.add_argument("--rows", type=int, default=64, help="responses on the rank")
    parser.add_argument("--prompt", type=span, default=(20, 25), help="A:B prompt tokens")
    parser.add_argument("--response", type=span, default=(10, 46), help="A:B response tokens")
    parser.add_argument("--micro", type=int, default=64, help="the learner's micro-batch")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--chunk-mib", type=float, default=1024.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return

    shape = Shape(args.model, args.rows, args.prompt, args.response, args.micro,
                  args.checkpointing, args.chunk_mib)  # fmt: skip
    rows = []
    floor = spawn("floor", args.steps, shape, args.threads)
    for name, seconds in floor.items():
        rows.append([name, seconds])
    fb = next(iter(floor.values()))  # forward + backward without checkpointing
    settings = ", gradient checkpointing" if shape.checkpointing else ""
    variants = [(f"learner step, micro-batch {shape.micro}{settings}", shape, ROOT)]
    if shape.checkpointing:
        unchecked = dataclasses.replace(shape, checkpointing=False)
        variants.append((f"learner step, micro-batch {shape.micro}", unchecked, ROOT))
    elif shape.micro == shape.rows:
        fused = f"learner step, micro-batch {shape.micro} (fused proximal pass)"
        variants[0] = (fused, shape, ROOT)
        half = dataclasses.replace(shape, micro=shape.rows // 2)
        variants.append((f"learner step, micro-batch {half.micro} (two passes)", half, ROOT))
    if args.before:  # the first variant's settings, on the other checkout's learner
        variants.append((f"learner step of {args.before.name}, micro-batch {shape.micro}"
                         f"{settings}", shape, args.before))  # fmt: skip
    for name, variant, tree in variants:
        rows.append([name, spawn("learner", args.steps, variant, args.threads, tree)["step"]])
    command = f".venv/bin/python benchmarks/bench_learner.py --steps {args.steps}"
    if args.model != "chain_sum" or shape != Shape():
        command += (f" --model {args.model} --rows {args.rows} --prompt {args.prompt[0]}:"
                    f"{args.prompt[1]} --response {args.response[0]}:{args.response[1]} "
                    f"--micro {args.micro} --chunk-mib {args.chunk_mib:g}"
                    + (" --checkpointing" if args.checkpointing else ""))  # fmt: skip
    command += f" --threads {args.threads}" if args.threads != 1 else ""
    command += f" --before {args.before}" if args.before else ""
    report(
        f"One learner rank's step on {args.model} vs the plain-torch floor",
        [f"variant ({args.threads} thread(s), {args.rows} responses)", "median s",
         "x floor (fwd + bwd)"],
        [[name, f"{s:.3f}", f"{s / fb:.2f}"] for name, s in rows],
        out=args.out,
        command=command,
    )  # fmt: skip


if __name__ == "__main__":
    main()
