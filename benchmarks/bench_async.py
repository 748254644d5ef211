"""Sync vs async training on the CPU default: wall time per learner step, generator idle
fraction, staleness, and held-out accuracy after the same number of learner steps.

    .venv/bin/python benchmarks/bench_async.py [--steps 30] [--seeds 0 1] [--warmup 3]
        [--modes sync async async-in-flight] [--set KEY=VALUE ...] [--title TEXT]
        [--out benchmarks/results/bench_async.md [--append]]

Each run is `python -m cagrpo_ray.run` as a subprocess (its own local Ray cluster), with
configs/cpu-tiny.yaml (sync) or configs/cpu-tiny.yaml + configs/async.yaml (async: bound 1,
truncated IS at 2; async-in-flight: the same with `rollout.weight_update=in_flight`, replicas
loading new weights with their requests frozen), the same seeds and the same number of learner
steps. The runs alternate modes (sync, async, sync, async) so that the machine's drift hits
every mode alike. Per-step time is
`time/step` from metrics.jsonl (the first `--warmup` steps left out); held-out accuracy is
pass@1 on 200 held-out prompts x 4 samples, compared per prompt between the two modes.
`--set` passes config overrides to every run (e.g. `rollout.num_generators=1
learner.num_learners=1` gives generators and learner a core each, as on a GPU cluster where
they own separate devices).
Set CAGRPO_CPU_LOCK to a file to take it (flock) around each run on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from cagrpo_ray.metrics.provenance import markdown_table, report

ROOT = Path(__file__).resolve().parent.parent
ASYNC = ["configs/cpu-tiny.yaml", "configs/async.yaml"]
MODES = {  # mode -> (configs, its own overrides)
    "sync": (["configs/cpu-tiny.yaml"], []),
    "async": (ASYNC, []),
    # replicas load new weights with their requests frozen instead of draining them first
    "async-in-flight": (ASYNC, ["rollout.weight_update=in_flight"]),
}


def run(mode: str, seed: int, steps: int, out: Path, extra: list[str]) -> Path:
    name = f"{mode}-seed{seed}"
    command = [sys.executable, "-m", "cagrpo_ray.run"]
    configs, own = MODES[mode]
    for config in configs:
        command += ["--config", config]
    for override in (
        f"run.name={name}",
        f"run.output_dir={out}",
        f"run.steps={steps}",
        f"run.seed={seed}",
        "run.checkpoint_every=0",
        "metrics.enabled=false",
        *own,
        *extra,
    ):
        command += ["--set", override]
    lock = os.environ.get("CAGRPO_CPU_LOCK")
    if lock:
        command = ["flock", lock, *command]
    print(f"running {name}: {' '.join(command)}", flush=True)
    log = out / f"{name}.log"
    with log.open("w") as f:
        subprocess.run(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    return out / name


def measure(run_dir: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["step"] > warmup]
    staleness = [r["staleness/mean"] for r in timed]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_s": float(np.mean([r["time/step"] for r in timed])),
        "train_s": float(np.mean([r["time/train"] for r in timed])),
        "idle": float(np.mean([r["generators/idle_fraction"] for r in timed])),
        "staleness": float(np.mean(staleness)),
        "staleness_max": max(r["staleness/max"] for r in timed),
        "dropped": records[-1]["buffer/dropped_stale_groups"],
        "before": summary["eval_before"]["pass@1"],
        "after": summary["eval_after"]["pass@1"],
        "per_prompt": [p["num_correct"] for p in summary["eval_after"]["per_prompt"]],
        "samples": summary["eval_after"]["samples"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["sync", "async"],
                        help="the first is the reference of the paired table")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--title", default=None, help="heading of this result section")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--append", action="store_true", help="add to --out, do not replace it")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        for mode in args.modes:
            run_dir = run(mode, seed, args.steps, work, args.overrides)
            results[mode, seed] = measure(run_dir, args.warmup)

    reference, paired = args.modes[0], []
    for mode in args.modes[1:]:
        ratios, diffs = [], []
        for seed in args.seeds:
            s, a = results[reference, seed], results[mode, seed]
            ratio = s["step_s"] / a["step_s"]
            d = (np.array(a["per_prompt"]) - np.array(s["per_prompt"])) / s["samples"]
            se = d.std(ddof=1) / math.sqrt(len(d))
            ratios.append(ratio)
            diffs.append(d)
            paired.append([mode, seed, f"{ratio:.2f}x", f"{d.mean():+.3f} +- {se:.3f}"])
        d = np.concatenate(diffs)
        se = d.std(ddof=1) / math.sqrt(len(d))
        paired.append([mode, "all", f"{np.mean(ratios):.2f}x", f"{d.mean():+.3f} +- {se:.3f}"])

    if args.out and not args.append:
        args.out.write_text("")  # without --append the section replaces the file
    sets = "".join(f" --set {o}" for o in args.overrides)
    report(
        args.title or f"{' vs '.join(args.modes)} training, {args.steps} learner steps per run",
        [
            "seed",
            "mode",
            "s/step",
            "train s",
            "generator idle",
            "staleness mean (max)",
            "dropped",
            "held-out pass@1 before -> after",
        ],
        [
            [
                seed,
                mode,
                f"{r['step_s']:.2f}",
                f"{r['train_s']:.2f}",
                f"{r['idle']:.2f}",
                f"{r['staleness']:.2f} ({r['staleness_max']})",
                r["dropped"],
                f"{r['before']:.3f} -> {r['after']:.3f}",
            ]
            for (mode, seed), r in results.items()
        ],
        out=args.out,
        notes=[
            markdown_table(
                [
                    "mode",
                    "seed",
                    f"{reference} s/step / its s/step",
                    f"its pass@1 - {reference}'s (paired, +- 1 SE)",
                ],
                paired,
            )  # fmt: skip
        ],
        command=f".venv/bin/python benchmarks/bench_async.py --steps {args.steps} "
        f"--seeds {' '.join(map(str, args.seeds))} --warmup {args.warmup} "
        f"--modes {' '.join(args.modes)}{sets}",
    )


if __name__ == "__main__":
    main()
