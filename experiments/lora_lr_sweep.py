"""Full fine-tuning against LoRA on SmolLM2-135M-Instruct, each at the lr one small sweep picks.

The rule, the same for both methods: three learning rates half a decade apart around the
method's customary value (full 1e-5, LoRA 10x that: 1e-4), 10 steps each of the shipped
config (`configs/cpu-smollm2.yaml`, `configs/cpu-smollm2-lora.yaml`: same prompts in the same
order, the same seed), and the lr with the highest mean training reward over those 10 steps
wins. The lr warm-up is a fixed number of steps, so the first 10 steps of a 30-step run are a
10-step run; a centre lr that has a 30-step run is read from it. Then each winner runs 30 steps
with the held-out evaluation before and after, and the table of both is printed.

    .venv/bin/python experiments/lora_lr_sweep.py --out runs/lr-sweep

Resumable: a run with a `summary.json` is done and read, a run with a checkpoint continues.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

CONFIGS = {"full": "configs/cpu-smollm2.yaml", "lora": "configs/cpu-smollm2-lora.yaml"}
CENTRE = {"full": 1e-5, "lora": 1e-4}
FACTORS = (0.3, 1.0, 3.0)
SWEEP_STEPS = 10
FINAL_STEPS = 30
# The sweep's runs evaluate as little as the config allows: the held-out table is the 30-step runs'.
SWEEP_EVAL = ["data.eval_size=4", "eval.samples=1", "eval.temperatures=[]"]


def run_name(method: str, lr: float, steps: int) -> str:
    return f"{method}-lr{lr:.0e}-{steps}steps"


def train(out: Path, method: str, lr: float, steps: int) -> Path:
    name = run_name(method, lr, steps)
    run_dir = out / name
    if finished(run_dir, steps):
        return run_dir
    sets = [f"algorithm.lr={lr:g}", f"run.steps={steps}", f"run.name={name}"]
    sets += [f"run.output_dir={out}"]
    sets += ["metrics.port=0", "metrics.inspect_port=null"]  # no fixed port another job may hold
    if steps == SWEEP_STEPS:
        sets += ["run.checkpoint_every=0", "run.save_policy=never", *SWEEP_EVAL]
    cmd = [sys.executable, "-m", "cagrpo_ray.run", "--config", CONFIGS[method], "--resume", "auto"]
    for s in sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return run_dir


def finished(run_dir: Path, steps: int) -> bool:
    """Whether `run_dir` holds a run that reached `steps` (a stopped run leaves a summary too)."""
    summary = run_dir / "summary.json"
    return summary.exists() and json.loads(summary.read_text()).get("final_step") == steps


def train_rewards(run_dir: Path, steps: int) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {int(r["learner/step"]): r["reward/mean"] for r in rows if "reward/mean" in r}
    return [by_step[s] for s in range(1, steps + 1)]


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/lr-sweep"))
    ap.add_argument("--sweep-only", action="store_true", help="Stop after the sweep's table.")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    winners = {}
    print("| method | lr | mean training reward, steps 1-10 | SE (10 steps) |\n|---|---|---|---|")
    table = []
    for method in CONFIGS:
        scores = {}
        for f in FACTORS:
            lr = CENTRE[method] * f
            final = args.out / run_name(method, lr, FINAL_STEPS)
            run_dir = final if finished(final, FINAL_STEPS) else None
            if run_dir is None:
                run_dir = train(args.out, method, lr, FINAL_STEPS if f == 1.0 else SWEEP_STEPS)
            scores[lr] = mean_se(train_rewards(run_dir, SWEEP_STEPS))
            table.append(f"| {method} | {lr:.0e} | {scores[lr][0]:.3f} | {scores[lr][1]:.3f} |")
        winners[method] = max(scores, key=lambda lr: scores[lr][0])
    print("\n".join(table))
    print("winners:", {m: f"{lr:.0e}" for m, lr in winners.items()}, flush=True)
    if args.sweep_only:
        return
    for method, lr in winners.items():
        run_dir = train(args.out, method, lr, FINAL_STEPS)
        summary = json.loads((run_dir / "summary.json").read_text())
        before = json.loads((run_dir / "eval_before.json").read_text())
        print(f"{method} lr {lr:.0e}: before {json.dumps(before)[:400]}")
        after = {k: v for k, v in summary.items() if k.startswith("eval")}
        print(f"{method} lr {lr:.0e}: summary eval {after}")


if __name__ == "__main__":
    main()
