"""Full fine-tuning against a LoRA adapter on SmolLM2-135M-Instruct, side by side in one run.

    .venv/bin/python benchmarks/bench_lora.py [--rank 8] [--steps 3] [--system-steps 3] [--out FILE]

Two parts, each variant in its own process, one after the other (run it on an idle machine):

1. One learner rank (ZeRO-2, one process, two threads) on what a rank of
   configs/cpu-smollm2.yaml trains on (16 responses, ~70-token prompts, responses of 30-170
   tokens, gradient checkpointing): the median step time over `--steps` steps after two
   warm-up steps, the process's peak resident memory (`ru_maxrss`, which includes the model,
   the optimizer state and the step's activations), the trainable parameters, and what one
   weight sync moves (the tensors `iter_sync_weights` yields: bytes and seconds to produce them).
2. The whole system: `python -m cagrpo_ray.run --config configs/cpu-smollm2.yaml` for
   `--system-steps` steps, with and without `--set model.lora.rank=R`: the mean step time
   after the first step, the learner's step, and the sync's bytes and seconds, from the run's
   metrics.jsonl. The runs sample different tokens once their policies differ, so step times
   compare systems, not identical work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from cagrpo_ray.metrics.provenance import report  # noqa: E402

SHAPE = dict(model="smollm2-135m-instruct", rows=16, prompt=(66, 75), response=(30, 171),
             micro=16, checkpointing=True, chunk_mib=256.0)  # fmt: skip
THREADS = 2


def learner_child(rank: int, steps: int) -> dict:
    """One learner rank's numbers for LoRA rank `rank` (0: full fine-tuning)."""
    import torch
    from bench_learner import Shape, batch, free_port

    from cagrpo_ray.algo import LossSpec
    from cagrpo_ray.config.sections import DEFAULT_LORA_TARGETS
    from cagrpo_ray.learner.learner import Learner
    from cagrpo_ray.learner.settings import LearnerSettings
    from cagrpo_ray.policies.build import resolve_policy
    from cagrpo_ray.policies.lora import LoraSpec

    torch.set_num_threads(THREADS)
    shape = Shape(**SHAPE)
    lora = LoraSpec(rank, 2.0 * rank, 0.0, DEFAULT_LORA_TARGETS) if rank else None
    settings = LearnerSettings(resolve_policy(shape.model), zero_stage=2, lr=1e-5,
                               micro_batch_size=shape.micro,
                               max_response_length=shape.response[1] - 1, warmup_steps=5,
                               gradient_checkpointing=True, logits_chunk_mib=shape.chunk_mib,
                               num_threads=THREADS, lora=lora)  # fmt: skip
    learner = Learner(settings, LossSpec("cagrpo"), rank=0, world_size=1,
                      master_addr="127.0.0.1", master_port=free_port())  # fmt: skip
    data = batch(shape)
    for _ in range(2):
        learner.train_step(data)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        learner.train_step(data)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    sync_bytes = sum(t.numel() * t.element_size() for _, t in learner.iter_sync_weights())
    sync_s = time.perf_counter() - start
    module = learner.engine.module
    return {
        "step_s": statistics.median(times),
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "sync_mib": sync_bytes / 2**20,
        "sync_iter_s": sync_s,
    }


def spawn_learner(rank: int, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(THREADS))
    command = [sys.executable, __file__, "--child", str(rank), "--steps", str(steps)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"learner with LoRA rank {rank} failed:\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def run_system(rank: int, steps: int, workdir: Path) -> dict:
    """A whole run of configs/cpu-smollm2.yaml; its per-step means from metrics.jsonl."""
    name = f"lora{rank}" if rank else "full"
    command = [sys.executable, "-m", "cagrpo_ray.run", "--config", "configs/cpu-smollm2.yaml",
               "--set", f"run.steps={steps}", "--set", f"run.name={name}",
               "--set", f"run.output_dir={workdir}", "--set", "run.checkpoint_every=0",
               "--set", "run.save_policy=never", "--set", "metrics.enabled=false",
               "--set", "data.eval_size=8"]  # fmt: skip
    if rank:
        command += ["--set", f"model.lora.rank={rank}", "--set", f"model.lora.alpha={2 * rank}"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"run {name} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / name / "metrics.jsonl").open()]
    later = rows[1:] or rows

    def mean(key: str, of=later) -> float:
        values = [r[key] for r in of if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {
        "step_s": mean("time/step"),
        "train_s": mean("time/train_step_s"),
        "sync_mib": mean("sync/bytes", rows) / 2**20,
        "sync_s": mean("sync/seconds", rows),
        "mismatch_max": max(
            (r.get("logprob/mismatch_max", float("nan")) for r in later), default=float("nan")
        ),  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8, help="the adapter's LoRA rank")
    parser.add_argument("--steps", type=int, default=3, help="timed learner steps")
    parser.add_argument("--system-steps", type=int, default=3, help="steps of each whole run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(learner_child(args.child, args.steps)), flush=True)
        return

    variants = [("full fine-tuning", 0), (f"LoRA rank {args.rank}", args.rank)]
    learner = {name: spawn_learner(rank, args.steps) for name, rank in variants}
    command = (f".venv/bin/python benchmarks/bench_lora.py --rank {args.rank} --steps "
               f"{args.steps} --system-steps {args.system_steps}")  # fmt: skip
    report(
        "One learner rank on SmolLM2-135M-Instruct: full fine-tuning vs LoRA",
        ["variant", "median step s", "peak RSS GiB", "trainable params", "sync MiB",
         "sync tensors s"],
        [[name, f"{r['step_s']:.2f}", f"{r['peak_gib']:.2f}", f"{r['trainable']:,}",
          f"{r['sync_mib']:.2f}", f"{r['sync_iter_s']:.3f}"]
         for name, r in learner.items()],
        out=args.out,
        command=command,
    )  # fmt: skip
    if args.system_steps:
        with tempfile.TemporaryDirectory() as tmp:
            system = {
                name: run_system(rank, args.system_steps, Path(tmp)) for name, rank in variants
            }
        report(
            f"The whole system, configs/cpu-smollm2.yaml, {args.system_steps} steps each",
            ["variant", "mean step s (after 1)", "learner step s", "sync MiB", "sync s",
             "max logprob mismatch"],
            [[name, f"{r['step_s']:.1f}", f"{r['train_s']:.1f}", f"{r['sync_mib']:.2f}",
              f"{r['sync_s']:.2f}", f"{r['mismatch_max']:.2e}"]
             for name, r in system.items()],
            out=args.out,
            command=command,
        )  # fmt: skip


if __name__ == "__main__":
    main()
