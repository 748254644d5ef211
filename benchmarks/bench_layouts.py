"""Which layout of generator replicas and learner ranks is fastest for a config on this machine.

    flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_layouts.py \\
        [--config configs/cpu-smollm2.yaml] [--layouts 2x2,1x2,2x1] [--warmup 1] [--steps 2] \\
        [--out benchmarks/results/bench_layouts.md]

Each layout `GxL` (G generator replicas, L learner ranks) runs the config's own command
(`python -m cagrpo_ray.run`), one after another, for `--warmup` untimed and `--steps` timed
learner steps, with the same data, seeds and batch; only `rollout.num_generators` and
`learner.num_learners` change (the trainer shares the cores among the generators' workers, and
a learner rank takes the cores its count leaves it: one thread each of two on 2 cores, two for
one). A layout with a single rank trains the whole batch on it, so its micro-batch is doubled
to keep the number of passes per rank; the planner's memory check must pass for it to run.
Set-up and the before/after evaluation are outside the timed steps. The table gives the mean
s/step of the timed steps and its phases (`time/wait_batch`: generation, scoring and the wait
for the weights; `time/train`: the learner step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_trl import run_command  # noqa: E402

from cagrpo_ray.metrics.provenance import report  # noqa: E402


def run_layout(config: str, generators: int, learners: int, args, workdir: Path) -> dict:
    from cagrpo_ray.config import load_config

    micro = load_config(config).learner.micro_batch_size
    out = workdir / f"{generators}x{learners}"
    sets = [
        f"run.output_dir={out}",
        "run.name=layout",
        f"run.steps={args.warmup + args.steps}",
        "run.checkpoint_every=0",
        "run.save_policy=never",
        "metrics.enabled=false",
        "data.eval_size=2",
        "eval.samples=1",
        "eval.temperatures=[]",
        f"rollout.num_generators={generators}",
        f"learner.num_learners={learners}",
        f"learner.micro_batch_size={micro * 2 // learners}",
    ]
    command, env = run_command(config, sets)
    log = workdir / f"{generators}x{learners}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        status = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if status.returncode:
        return {"failed": f"exit {status.returncode}: {log.read_text()[-300:]!r}"}
    lines = (out / "layout" / "metrics.jsonl").read_text().splitlines()
    records = sorted((json.loads(x) for x in lines if x.strip()), key=lambda r: r["step"])
    timed = records[args.warmup :]
    result = {k: statistics.mean(r[k] for r in timed)
              for k in ("time/step", "time/wait_batch", "time/train", "time/sync")}  # fmt: skip
    result["wall"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu-smollm2.yaml")
    parser.add_argument("--layouts", default="2x2,1x2,2x1", help="GxL, comma-separated")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_layouts_") as tmp:
        for layout in args.layouts.split(","):
            generators, learners = (int(x) for x in layout.split("x"))
            r = run_layout(args.config, generators, learners, args, Path(tmp))
            print(layout, r, flush=True)
            name = f"{generators} generator(s), {learners} learner rank(s)"
            if "failed" in r:
                rows.append([name, "failed", "", "", "", r["failed"][:80]])
                continue
            rows.append([name, f"{r['time/step']:.1f}", f"{r['time/wait_batch']:.1f}",
                         f"{r['time/train']:.1f}", f"{r['time/sync']:.2f}",
                         f"{r['wall']:.0f}"])  # fmt: skip
    report(
        f"Layouts of {args.config}",
        ["layout", "s/step", "time/wait_batch s", "time/train s", "time/sync s", "whole run s"],
        rows,
        out=args.out,
        notes=[f"{args.warmup} untimed step(s), then the mean of {args.steps} timed steps."],
        command=f"flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_layouts.py "
        f"--config {args.config} --layouts {args.layouts} --warmup {args.warmup} "
        f"--steps {args.steps}",
    )


if __name__ == "__main__":
    main()
