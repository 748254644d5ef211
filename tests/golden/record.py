"""Record the golden per-step metrics of the schedule: python tests/golden/record.py [--out F].

Runs the embedded default for a few steps with staleness bound 0 (the synchronous schedule)
and writes every learner step's metrics plus the held-out evaluations, with the machine it ran
on. `tests/test_golden_schedule.py` reruns the same config and compares, bit for bit: a change
meant to keep the numbers (a refactor, a speed-up) must keep them, and a change meant to move
them re-records the file and says why in its commit.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).parent
STEPS = 10
# name -> overrides on configs/cpu-tiny.yaml (the learner's defaults: groups split by tokens,
# shared prompts).
RUNS = {"bound0": ["run.max_staleness=0"]}


def overrides(out_dir: Path, name: str) -> list[str]:
    return [
        f"run.output_dir={out_dir}",
        f"run.name={name}",
        f"run.steps={STEPS}",
        "run.checkpoint_every=0",
        "data.eval_size=32",
        "eval.samples=4",
        "metrics.port=0",
        "sync.timeout_s=60",
        *RUNS[name],
    ]


def policy_digest() -> str:
    """sha256 of the built-in policy's weights (the preset the runs start from)."""
    import hashlib

    from cagrpo_ray.policies.build import resolve_policy

    weights = Path(resolve_policy("chain_sum")) / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()).hexdigest()


def machine() -> dict:
    import torch

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "policy_sha256": policy_digest(),
    }


def record(out_dir: Path, run_one) -> dict:
    """`run_one(config, name) -> (summary, metrics records)` for each run in RUNS."""
    from cagrpo_ray.config import load_config

    runs = {}
    for name in RUNS:
        config = load_config("configs/cpu-tiny.yaml", overrides(out_dir, name))
        summary, records = run_one(config, name)
        runs[name] = {
            "steps": records,
            "eval_before": {k: v for k, v in summary["eval_before"].items() if k != "per_prompt"},
            "eval_after": {k: v for k, v in summary["eval_after"].items() if k != "per_prompt"},
        }
    from cagrpo_ray.metrics.provenance import git_commit

    return {"machine": machine(), "recorded_by": git_commit(HERE.parent.parent), "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=HERE / "schedule_metrics.json")
    parser.add_argument("--workdir", type=Path, default=Path("runs/golden"))
    args = parser.parse_args()
    import ray

    sys.path.insert(0, str(HERE.parent))
    from golden_runner import run_one  # noqa: E402  (tests/golden_runner.py: the current API)

    ray.init(num_cpus=3, include_dashboard=False)
    try:
        result = record(args.workdir, run_one)
    finally:
        ray.shutdown()
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
