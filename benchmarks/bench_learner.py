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
"""

from __future__ import annotations

import argparse
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

ROWS, GROUP = 64, 8


def batch(seed: int = 0):
    """A rank's learner batch of the default's shapes (keys of both learner APIs)."""
    import torch

    from cagrpo_ray.algo.advantages import group_advantages

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(20, 25, (ROWS,), generator=g)
    response = torch.randint(10, 46, (ROWS,), generator=g)
    width = int((prompt + response).max())
    columns = torch.arange(width)
    attention = (columns < (prompt + response)[:, None]).long()
    response_mask = (columns >= prompt[:, None]) & attention.bool()
    rewards = torch.randint(0, 2, (ROWS,), generator=g).float()
    return {
        "input_ids": torch.randint(3, 17, (ROWS, width), generator=g) * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
        "behavior_logprobs": -torch.rand(ROWS, width, generator=g) * response_mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, GROUP),
        "group_ids": torch.arange(ROWS // GROUP).repeat_interleave(GROUP),
        "policy_version": torch.zeros(ROWS, dtype=torch.long),
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


def run_floor(steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from cagrpo_ray.policies.build import resolve_policy

    model = AutoModelForCausalLM.from_pretrained(resolve_policy("chain_sum")).train()
    ids = torch.randint(3, 17, (ROWS, 48), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).mean().backward()

    def forward():
        with torch.no_grad():
            model(input_ids=ids)

    return {
        "floor: forward + backward, 64 x 48 unpadded": timed(forward_backward, steps),
        "floor: forward, 64 x 48 unpadded": timed(forward, steps),
    }


def run_learner(steps: int, micro: int) -> dict:
    """The learner of whichever checkout is first on sys.path (either API)."""
    from cagrpo_ray.policies.build import resolve_policy

    path = resolve_policy("chain_sum")
    rank = dict(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
    try:
        from cagrpo_ray.algo import LossSpec
        from cagrpo_ray.learner.learner import Learner
        from cagrpo_ray.learner.settings import LearnerSettings

        settings = LearnerSettings(path, zero_stage=2, lr=1e-5, micro_batch_size=micro,
                                   max_response_length=64, warmup_steps=5)  # fmt: skip
        learner = Learner(settings, LossSpec("cagrpo"), **rank)
    except ImportError:  # an older checkout: keyword arguments
        from cagrpo_ray.learner.learner import Learner

        learner = Learner(path, **rank, zero_stage=2, lr=1e-5, micro_batch_size=micro,
                          policy_loss="cagrpo", max_response_length=64, warmup_steps=5)  # fmt: skip
    data = batch()
    return {"step": timed(lambda: learner.train_step(data), steps)}


def child(args) -> None:
    import torch

    torch.set_num_threads(1)
    if args.variant == "floor":
        result = run_floor(args.steps)
    else:
        result = run_learner(args.steps, args.micro)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(variant: str, steps: int, micro: int = 64, tree: Path = ROOT) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    command = [sys.executable, __file__, "--child", variant, "--steps", str(steps),
               "--micro", str(micro)]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--before", type=Path, help="another checkout's root, to compare")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", dest="variant", help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=64, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return

    rows = []
    floor = spawn("floor", args.steps)
    for name, seconds in floor.items():
        rows.append([name, seconds])
    fb = floor["floor: forward + backward, 64 x 48 unpadded"]
    variants = [("learner step, micro-batch 64 (fused proximal pass)", 64, ROOT),
                ("learner step, micro-batch 32 (two passes)", 32, ROOT)]  # fmt: skip
    if args.before:
        variants.append((f"learner step of {args.before.name}, micro-batch 32", 32, args.before))
    for name, micro, tree in variants:
        rows.append([name, spawn("learner", args.steps, micro, tree)["step"]])
    report(
        "One learner rank's step on the default config vs the plain-torch floor",
        ["variant (1 thread, 64 responses)", "median s", "x floor (fwd + bwd)"],
        [[name, f"{s:.3f}", f"{s / fb:.2f}"] for name, s in rows],
        out=args.out,
        command=f".venv/bin/python benchmarks/bench_learner.py --steps {args.steps}"
        + (f" --before {args.before}" if args.before else ""),
    )


if __name__ == "__main__":
    main()
