"""The third evidence round: CA-GRPO against GRPO on SmolLM2-135M-Instruct, trained at T=0.7.

One resumable command runs the plan of `docs/results/evidence3.md` (`study3_plan.py`) and
rebuilds its results table:

    .venv/bin/python experiments/study3.py --out runs/study3

Stages: the mechanism of SmolLM2's kernel at T=0.7 and T=1 (`kernel_anatomy.py`, no training),
the GRPO lr probe, the grid of both methods, the seeds at each method's chosen lr, then the
test split on every final policy and the starting one. A finished run (its `summary.json`) is
skipped; a stopped one resumes from its newest checkpoint (`--resume`; every run checkpoints
every 10 steps), so `touch <out>/STOP` (the study ends after the current run) or a killed
command loses at most 10 steps. Runs execute from a pinned snapshot of the package (as round 1,
`study.py`), serialized by `flock`. The rules' choices go to `<out>/choices.json` once the runs
they read have finished; the test split is read only once every training run has ended.
`--aggregate-only` only rewrites the table, `docs/results/evidence3/runs.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
from pathlib import Path

import study3_plan as plan
from study import LOCK, execute, pinned_source

from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import read_metrics

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv/bin/python")
TEST_SETTINGS = {"T0.7": ("0.7", "4"), "T0": ("0", "1")}  # temperature, samples a prompt


def finished(run: plan.Run, out: Path) -> tuple[list[dict], dict] | None:
    """(metrics records, summary) of a finished run, else None."""
    summary = out / run.name / "summary.json"
    if not summary.exists():
        return None
    return read_metrics(out / run.name / "metrics.jsonl"), json.loads(summary.read_text())


def choices(out: Path) -> dict:
    """What the rules chose so far (each only once every run it reads has finished)."""
    made: dict = {}
    probes = {r.lr: finished(r, out) for r in plan.probe_runs()}
    if all(probes.values()):
        center, why = plan.probe_lr({lr: done[0] for lr, done in probes.items()})
        made.update(probe_lr=center, probe_why=why, grid_lrs=plan.grid_lrs(center))
        grid = plan.grid_runs(center)
        if all(finished(r, out) for r in grid):
            made["chosen_lr"], made["chosen_why"] = {}, {}
            for method in plan.METHODS:
                runs = {r.lr: finished(r, out) for r in grid if r.method == method}
                made["chosen_lr"][method], made["chosen_why"][method] = plan.chosen_lr(runs)
    return made


def planned(out: Path) -> list[plan.Run]:
    """The training runs the rules plan so far, in order."""
    made = choices(out)
    runs = plan.probe_runs()
    if "probe_lr" in made:
        runs += plan.grid_runs(made["probe_lr"])
    if "chosen_lr" in made:
        runs += plan.seed_runs(made["chosen_lr"])
    return runs


def train_command(run: plan.Run, out: Path) -> list[str]:
    argv = [*_locked(PYTHON, "-m", "cagrpo_ray.run", "--config", plan.CONFIG)]
    for key, value in {**run.settings(), "run.output_dir": str(out.resolve())}.items():
        argv += ["--set", f"{key}={value}"]
    if (out / run.name / "checkpoints" / "latest").exists():
        argv.append("--resume")
    return argv


def _locked(*argv: str) -> list[str]:
    return ["flock", LOCK, *argv]


def anatomy_command(out: Path, temperature: str) -> list[str]:
    return _locked(
        PYTHON, str(REPO / "experiments/kernel_anatomy.py"), "--config", plan.CONFIG,
        "--temperature", temperature, "--prompts", "8", "--seeds", "0", "1",
        "--chunk-rows", "16", "--no-step",
        "--out", str((out / f"anatomy-smollm2-T{temperature}.json").resolve()),
    )  # fmt: skip


def test_source() -> str:
    """The run's held-out split, long enough for the validation and the test prompts."""
    data = load_config(REPO / plan.CONFIG).data
    config = "&".join(f"{k}={v}" for k, v in data.dataset_config.items())
    size = plan.VALIDATION_SIZE + plan.TEST_SIZE
    return (
        f"reasoning_gym:{data.dataset}?seed={data.seed}&size={size}"
        f"&exclude_train={data.train_size}&{config}"
    )


def test_command(model: str, result: Path, key: str) -> list[str]:
    config = load_config(REPO / plan.CONFIG)
    temperature, samples = TEST_SETTINGS[key]
    return _locked(
        PYTHON, "-m", "cagrpo_ray.eval", "--model", model, "--data", test_source(),
        "--offset", str(plan.VALIDATION_SIZE), "--limit", str(plan.TEST_SIZE),
        "--samples", samples, "--temperature", temperature,
        "--max-tokens", str(config.rollout.max_tokens),
        "--max-model-len", str(config.rollout.max_model_len),
        "--weights", json.dumps(config.reward.weights),
        "--instruction", config.data.instruction, "--seed", "0", "--out", str(result),
    )  # fmt: skip


def run_logged(argv: list[str], log: Path, src: Path) -> int:
    """One command in the pinned snapshot (its cwd too, so `-m cagrpo_ray...` imports it)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(src.resolve())}
    print(f"[study3] {shlex.join(argv)}", flush=True)
    with log.open("w") as handle:
        done = subprocess.run(argv, cwd=src, env=env, stdout=handle, stderr=subprocess.STDOUT)
    return done.returncode


def test_results(out: Path) -> dict[str, dict[str, float]]:
    """{run name or "start": {"T0.7": pass@1, "T0": pass@1}} for what the test stage wrote."""
    results: dict = {}
    for path in sorted(out.glob("test/*.json")):
        name, _, key = path.stem.rpartition("-")
        results.setdefault(name, {})[key] = json.loads(path.read_text())["metrics"]["pass@1"]
    return results


def verdict(out: Path, made: dict) -> dict | None:
    """The pre-registered decision rule on the test split, once every run has its result."""
    tests = test_results(out)
    chosen = made.get("chosen_lr")
    if not chosen:
        return None
    by_seed = {m: {} for m in plan.METHODS}
    for method in plan.METHODS:
        runs = [plan.run("grid", method, chosen[method], 1)] + [
            r for r in plan.seed_runs(chosen) if r.method == method
        ]
        for r in runs:
            done = finished(r, out)
            if "T0.7" not in tests.get(r.name, {}) or done is None:
                return None
            ratio = plan.entropy_ratio(done[0])
            by_seed[method][r.seed] = (tests[r.name]["T0.7"], ratio)
    seeds = sorted(by_seed["grpo"])
    d = [by_seed["cagrpo"][s][0] - by_seed["grpo"][s][0] for s in seeds]
    ratios = [by_seed["cagrpo"][s][1] for s in seeds]
    mean = sum(d) / len(d)
    rng = random.Random(0)
    boots = sorted(sum(rng.choices(d, k=len(d))) / len(d) for _ in range(10_000))
    if mean >= 0.03 and all(x > 0 for x in d) and all(0.7 <= r <= 1.5 for r in ratios):
        call = "supports the paper"
    elif (mean <= -0.03 and sum(x < 0 for x in d) >= 2) or sum(r > 2 for r in ratios) >= 2:
        call = "contradicts the paper"
    else:
        call = "inconclusive"
    return {"d": d, "mean_d": mean, "bootstrap_95": [boots[250], boots[9750]],
            "cagrpo_entropy_ratios": ratios, "verdict": call}  # fmt: skip


def write_table(out: Path, page: Path) -> None:
    """The runs so far, the rules' choices and (once read) the test split and the verdict."""
    made = choices(out)
    lines = ["# Evidence, round 3: the runs (written by experiments/study3.py)", ""]
    lines += ["| run | steps | entropy ratio | validation pass@1 T=0.7 (start -> evals) |"]
    lines += ["|---|---|---|---|"]
    for r in planned(out):
        done = finished(r, out)
        if done is None:
            lines.append(f"| {r.name} | not finished | | |")
            continue
        records, summary = done
        curve = " / ".join(f"{v:.3f}" for v in plan.validation_curve(records, summary))
        start = summary["eval_before"]["pass@1"]
        lines.append(
            f"| {r.name} | {len(records)} | {plan.entropy_ratio(records):.2f} | "
            f"{start:.3f} -> {curve} |"
        )
    lines += ["", "Choices: `" + json.dumps(made) + "`", ""]
    tests = test_results(out)
    if tests:
        lines += ["| policy | test pass@1 T=0.7 | test pass@1 greedy |", "|---|---|---|"]
        for name, values in tests.items():
            cells = [f"{values[k]:.3f}" if k in values else "" for k in ("T0.7", "T0")]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        lines += ["", "Verdict: `" + json.dumps(verdict(out, made)) + "`"]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")
    (out / "choices.json").write_text(json.dumps(made, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs/study3", help="Run folder.")
    parser.add_argument("--page", type=Path, default=REPO / "docs/results/evidence3/runs.md")
    parser.add_argument("--aggregate-only", action="store_true", help="Only rewrite the table.")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands, run nothing.")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.aggregate_only:
        write_table(out, args.page)
        return 0
    commit, src = pinned_source(out)
    stop = out / "STOP"
    for temperature in ("0.7", "1"):
        if not (out / f"anatomy-smollm2-T{temperature}.json").exists() and not stop.exists():
            argv = anatomy_command(out, temperature)
            if args.dry_run:
                print(shlex.join(argv))
            else:
                run_logged(argv, out / f"anatomy-T{temperature}.log", src)
    while not stop.exists():
        todo = [r for r in planned(out) if finished(r, out) is None]
        if args.dry_run:
            for r in todo:
                print(shlex.join(train_command(r, out)))
            return 0
        if not todo:
            break
        execute(todo[0], out, commit, src, argv=train_command(todo[0], out))
        write_table(out, args.page)
        if finished(todo[0], out) is None:  # it failed, or a signal stopped it
            print(f"[study3] {todo[0].name} did not finish; rerun to resume it", flush=True)
            return 1
    if stop.exists():
        print(f"[study3] {stop} exists: no more runs started", flush=True)
        return 0
    # Every training run has ended: now, and only now, the test split.
    (out / "test").mkdir(exist_ok=True)
    policies = {"start": "smollm2-135m-instruct"}
    policies.update({r.name: str(out / r.name / "policy") for r in planned(out)})
    for name, model in policies.items():
        for key in TEST_SETTINGS:
            result = out / "test" / f"{name}-{key}.json"
            if not result.exists() and not stop.exists():
                log = out / "test" / f"{name}-{key}.log"
                run_logged(test_command(model, result, key), log, src)
    write_table(out, args.page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
