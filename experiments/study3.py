"""The third evidence round: CA-GRPO against GRPO on SmolLM2-135M-Instruct, trained at T=0.7.

One resumable command runs the plan of `docs/results/evidence3.md` (`study3_plan.py`) and
rebuilds its results table:

    .venv/bin/python experiments/study3.py --out runs/study3

Stages: the mechanism of SmolLM2's kernel at T=0.7 and T=1 (`kernel_anatomy.py`, no training;
the batches missing from `docs/results/evidence3/`, written there), the GRPO lr probe, the grid
of both methods, the seeds at each method's chosen lr, then the test split on the starting
policy. A finished run (its `summary.json`) is
skipped; a stopped one resumes from its newest checkpoint (`--resume`; every run checkpoints
every 10 steps), so `touch <out>/STOP` (the study ends after the current run) or a killed
command loses at most 10 steps. Runs execute from a pinned snapshot of the package (as round 1,
`study.py`), serialized by `flock`. The rules' choices go to `<out>/choices.json` once the runs
they read have finished. `--aggregate-only` only rewrites the table,
`docs/results/evidence3/runs.md`.

The study outlives the machine it runs on through `docs/results/evidence3/kept/` (committed):
each finished run's metrics, summary, provenance and config, its test-split results, and the
pinned commit. A new run folder starts from that archive, so the plan carries on where the
last machine stopped. A run's final policy (540 MB) does not travel, so each grid and seeds
run is evaluated on the test split as soon as it finishes; no rule reads those results
(`choices` reads only metrics and summaries) and the table shows them only once every planned
run has finished. A run whose policy was lost with its machine before its test evaluation is
trained again at the end (the same command from the same commit, into `<out>/retrain/`) and
tested from there; `reproduced.json` in its kept folder says whether the second training
matched the first step by step. `--finish-by HH:MM` (UTC) starts the first planned run
expected to end, its test evaluation included, by then; a longer one waits for a later start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import study3_plan as plan
import study3_plots
from study import LOCK, ended_summary, execute, pinned_source

from cagrpo_ray.config import load_config
from cagrpo_ray.metrics.jsonl import read_metrics

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv/bin/python")
TEST_SETTINGS = {"T0.7": ("0.7", "4"), "T0": ("0", "1")}  # temperature, samples a prompt
EVIDENCE = REPO / "docs/results/evidence3"  # the anatomy's results, committed
ARCHIVE = EVIDENCE / "kept"  # what outlives a machine of the training runs, committed
FIGURE = "signals.png"  # beside the runs table: the finished runs' training and validation signals
KEPT = (
    "metrics.jsonl",
    "summary.json",
    "provenance.json",
    "config.json",
    "eval_before.json",
    "reproduced.json",
)
RETRAIN = "retrain"  # where a run whose final policy was lost untested is trained again
REPRODUCED_KEYS = ("reward/mean", "entropy/mean", "response/length_mean", "loss/total")
# Estimates for --finish-by before any run has finished here: seconds a step (start-up and
# evaluations included) and seconds of one run's test evaluation (1,024 + 256 completions).
STEP_S, TEST_S = 90.0, 900.0


def restore(out: Path, archive: Path = ARCHIVE) -> int:
    """Copy the archive's finished runs, test results and pinned commit into `out` where it
    lacks them; the number of runs brought in."""
    brought = 0
    for saved in sorted(archive.glob("*/summary.json")):
        target = out / saved.parent.name
        if (target / "summary.json").exists():
            continue
        target.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (saved.parent / name).exists():
                shutil.copy2(saved.parent / name, target / name)
        brought += 1
    for result in sorted(archive.glob("test/*.json")):
        if not (out / "test" / result.name).exists():
            (out / "test").mkdir(parents=True, exist_ok=True)
            shutil.copy2(result, out / "test" / result.name)
    if (archive / "SOURCE_COMMIT").exists() and not (out / "SOURCE_COMMIT").exists():
        shutil.copy2(archive / "SOURCE_COMMIT", out / "SOURCE_COMMIT")
    return brought


def keep(out: Path, name: str, archive: Path = ARCHIVE) -> None:
    """Put what outlives the machine of run `name` (or test result `test/<name>`) and the
    pinned commit into the archive."""
    archive.mkdir(parents=True, exist_ok=True)
    if (out / "SOURCE_COMMIT").exists():
        shutil.copy2(out / "SOURCE_COMMIT", archive / "SOURCE_COMMIT")
    source = out / name
    if source.is_file():
        (archive / source.parent.name).mkdir(exist_ok=True)
        shutil.copy2(source, archive / source.parent.name / source.name)
        return
    (archive / name).mkdir(exist_ok=True)
    for kept in KEPT:
        if (source / kept).exists():
            shutil.copy2(source / kept, archive / name / kept)


def expected_s(run: plan.Run, out: Path) -> float:
    """A run's expected wall time: its steps at the seconds a step of the runs that finished
    here with its method and lr (the median; a run's pace follows its responses' length, which
    its lr sets: GRPO's 1e-4 probe took 146 s a step, its 1e-5 grid run 36), else of every run
    that finished here, plus its test evaluation for a grid or seeds run.

    A run's seconds a step are the larger of its wall time over its steps and its steps' own
    times (`time/step` of its metrics): a resumed run's provenance holds the wall time of its
    last attempt only, which alone would make it look quick."""
    settings, rates, alike = run.settings(), [], []
    for path in out.glob("*/provenance.json"):
        provenance = json.loads(path.read_text())
        overrides = provenance.get("overrides", {})
        steps = int(overrides.get("run.steps", 0))
        if provenance.get("returncode") == 0 and steps:
            metrics = path.parent / "metrics.jsonl"
            records = read_metrics(metrics) if metrics.exists() else []
            stepped = sum(r.get("time/step", 0.0) for r in records)
            rates.append(max(provenance["wall_s"], stepped) / steps)
            if all(
                overrides.get(k) == settings[k] for k in ("algorithm.policy_loss", "algorithm.lr")
            ):
                alike.append(rates[-1])
    step_s = statistics.median(alike or rates) if rates else STEP_S
    return int(settings["run.steps"]) * step_s + (TEST_S if run.group != "probe" else 0)


def next_run(todo: list[plan.Run], out: Path, finish_by: str | None) -> plan.Run | None:
    """The first run of `todo` (plan order) expected to end by `finish_by` (HH:MM UTC; any run
    without it). A run that would not fit waits for a longer window: the order changes no
    result, since each rule reads its runs only once all of them have finished."""
    for run in todo:
        if finish_by is None or (expected := expected_s(run, out)) <= seconds_until(finish_by):
            return run
        print(f"[study3] {run.name} (~{expected / 60:.0f} min) would not end "
              f"by {finish_by} UTC: left for later", flush=True)  # fmt: skip
    return None


def seconds_until(clock: str, now: datetime | None = None) -> float:
    """Seconds from `now` (UTC) until the nearest HH:MM UTC (negative once it has passed; a
    clock more than 12 hours back is tomorrow's)."""
    now = now or datetime.now(UTC)
    hour, minute = (int(part) for part in clock.split(":"))
    left = (now.replace(hour=hour, minute=minute, second=0, microsecond=0) - now).total_seconds()
    return left + 86400 if left < -43200 else left


def finished(run: plan.Run, out: Path) -> tuple[list[dict], dict] | None:
    """(metrics records, summary) of a finished run, else None. A run stopped by a signal has
    a summary too (`stopped_at`, its checkpoint written): it is not finished, and resumes.
    A resumed run's summary takes its step-0 evaluation from `eval_before.json` where it
    lacks one (`step0_evaluation`)."""
    loaded = ended_summary(out / run.name)
    steps = int(run.settings()["run.steps"])
    if loaded is None or loaded.get("final_step", steps) != steps:
        return None
    if "eval_before" not in loaded:
        before = step0_evaluation(out, run.name)
        if before is not None:
            loaded["eval_before"] = before
    return read_metrics(out / run.name / "metrics.jsonl"), loaded


def step0_evaluation(out: Path, name: str) -> dict | None:
    """The step-0 evaluation of a run whose summary lacks it (a resumed run: the pinned
    trainer evaluates step 0 only in a run's first attempt): `<run>/eval_before.json`, else
    written there from the first attempt's line `eval (before, step 0): k=v, ...` in the run's
    log (`<out>/<name>.log`, which a resumed attempt appends to), at its 3 decimals."""
    kept = out / name / "eval_before.json"
    if kept.exists():
        return json.loads(kept.read_text())
    log = out / f"{name}.log"
    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        _, marker, values = line.partition("eval (before, step 0): ")
        if marker:
            result: dict = {}
            for pair in values.split(", "):
                key, _, value = pair.partition("=")
                result[key] = float(value)
            result["source"] = f"{log.name}, line 'eval (before, step 0)', as logged (3 decimals)"
            kept.write_text(json.dumps(result, indent=1))
            return result
    return None


def choices(out: Path) -> dict:
    """What the rules chose so far, each only once every run it reads has finished: a
    method's lr once its own three grid runs have (the rule reads no other method's runs)."""
    made: dict = {}
    probes = {r.lr: finished(r, out) for r in plan.probe_runs()}
    if all(probes.values()):
        center, why = plan.probe_lr({lr: done[0] for lr, done in probes.items()})
        made.update(probe_lr=center, probe_why=why, grid_lrs=plan.grid_lrs(center))
        for method in plan.METHODS:
            runs = {r.lr: finished(r, out) for r in plan.grid_runs(center) if r.method == method}
            if all(runs.values()):
                lr, why = plan.chosen_lr(runs)
                made.setdefault("chosen_lr", {})[method] = lr
                made.setdefault("chosen_why", {})[method] = why
    return made


def every_lr_chosen(made: dict) -> bool:
    return set(made.get("chosen_lr", {})) == set(plan.METHODS)


def planned(out: Path) -> list[plan.Run]:
    """The training runs the rules plan so far, in order."""
    made = choices(out)
    runs = plan.probe_runs()
    if "probe_lr" in made:
        runs += plan.grid_runs(made["probe_lr"])
    if "chosen_lr" in made:  # the seeds of each method whose lr is chosen, in plan order
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


def anatomy_missing(evidence: Path = EVIDENCE) -> list[tuple[str, str]]:
    """The (temperature, seed) batches of SmolLM2's anatomy not on the page's folder yet: a
    temperature's file holds both seeds (`anatomy-smollm2-T0.7.json`), a seed's file one."""
    return [
        (t, seed)
        for t in ("0.7", "1")
        for seed in ("0", "1")
        if not (evidence / f"anatomy-smollm2-T{t}.json").exists()
        and not (evidence / f"anatomy-smollm2-T{t}-seed{seed}.json").exists()
    ]


def anatomy_command(temperature: str, seed: str, evidence: Path = EVIDENCE) -> list[str]:
    return _locked(
        PYTHON, str(REPO / "experiments/kernel_anatomy.py"), "--config", plan.CONFIG,
        "--temperature", temperature, "--prompts", "8", "--seeds", seed,
        "--chunk-rows", "16", "--no-step",
        "--out", str((evidence / f"anatomy-smollm2-T{temperature}-seed{seed}.json").resolve()),
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
        "--instruction", config.data.instruction, "--seed", "0", "--out", str(result.resolve()),
    )  # fmt: skip


def test_policy(name: str, model: str, out: Path, src: Path, archive: Path = ARCHIVE) -> None:
    """The test split on one policy (a folder, or a built-in preset), at each setting it
    lacks, each result kept. The evaluation runs in the snapshot's folder: paths go absolute."""
    (out / "test").mkdir(exist_ok=True)
    if Path(model).exists():
        model = str(Path(model).resolve())
    for key in TEST_SETTINGS:
        result = out / "test" / f"{name}-{key}.json"
        if not result.exists():
            log = out / "test" / f"{name}-{key}.log"
            rc = run_logged(test_command(model, result, key), log, src)
            if result.exists():
                keep(out, f"test/{result.name}", archive)
            else:
                print(f"[study3] the test of {name} at {key} FAILED (rc {rc}); see {log}; "
                      "the next run of the study tries it again", flush=True)  # fmt: skip


def test_finished(out: Path, src: Path, archive: Path = ARCHIVE) -> None:
    """The test split on every finished grid or seeds run whose policy is here and whose
    test results are not all here (a run's policy does not outlive its machine)."""
    for r in planned(out):
        policy = out / r.name / "policy"
        if r.group != "probe" and finished(r, out) and not tested(r.name, out) and policy.exists():
            test_policy(r.name, str(policy), out, src, archive)


def tested(name: str, out: Path) -> bool:
    """Whether policy `name` has a test result at every setting."""
    return all((out / "test" / f"{name}-{key}.json").exists() for key in TEST_SETTINGS)


def retrain(run: plan.Run, out: Path, commit: str, src: Path, archive: Path = ARCHIVE) -> Path:
    """Train a finished run again, the same command from the same pinned commit, into
    `<out>/retrain/`, for a run whose final policy was lost with its machine before its test
    evaluation; its folder (and the archive) gets `reproduced.json`, how far the new run's
    training signals are from the kept run's step by step. Returns the new policy's folder."""
    again = out / RETRAIN
    again.mkdir(exist_ok=True)
    execute(run, again, commit, src, argv=train_command(run, again))
    if finished(run, again) is not None:
        kept = read_metrics(out / run.name / "metrics.jsonl")
        new = read_metrics(again / run.name / "metrics.jsonl")
        (out / run.name / "reproduced.json").write_text(json.dumps(reproduction(kept, new)))
        keep(out, run.name, archive)
    return again / run.name / "policy"


def reproduction(kept: list[dict], new: list[dict]) -> dict:
    """Per training signal, the largest |difference| between two runs' step records, and the
    first step at which any of them differs (None: identical at every step both have)."""
    pairs = list(zip(kept, new, strict=False))
    diffs = {
        key: max((abs(a[key] - b[key]) for a, b in pairs if key in a and key in b), default=0.0)
        for key in REPRODUCED_KEYS
    }
    first = next(
        (a["step"] for a, b in pairs if any(a.get(k) != b.get(k) for k in REPRODUCED_KEYS)), None
    )
    return {"steps_compared": len(pairs), "max_abs_diff": diffs, "first_differing_step": first}


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
    if not every_lr_chosen(made):
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


def all_finished(out: Path, made: dict) -> bool:
    """Whether the plan is complete: the seeds are planned and every planned run finished."""
    return every_lr_chosen(made) and all(finished(r, out) for r in planned(out))


def write_table(out: Path, page: Path) -> None:
    """The runs so far, the rules' choices and, once every run has finished, the test split
    and the verdict."""
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
    trained = [
        (r, *done)
        for r in planned(out)
        if r.group != "probe" and (done := finished(r, out)) is not None
    ]
    if trained:
        study3_plots.draw(trained, page.parent / FIGURE)
        lines += [f"![training and validation signals of the finished runs]({FIGURE})", ""]
    tests = test_results(out) if all_finished(out, made) else {}
    if tests:
        lines += ["| policy | test pass@1 T=0.7 | test pass@1 greedy |", "|---|---|---|"]
        for name, values in tests.items():
            cells = [f"{values[k]:.3f}" if k in values else "" for k in ("T0.7", "T0")]
            lines.append(f"| {name}{_retrained(out, name)} | {' | '.join(cells)} |")
        lines += ["", "Verdict: `" + json.dumps(verdict(out, made)) + "`"]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")
    (out / "choices.json").write_text(json.dumps(made, indent=2))


def _retrained(out: Path, name: str) -> str:
    """A note on a policy trained again for its test (`retrain`), else ""."""
    path = out / name / "reproduced.json"
    if not path.exists():
        return ""
    first = json.loads(path.read_text())["first_differing_step"]
    same = "identical at every step" if first is None else f"differs from step {first}"
    return f" (trained again for its test: {same})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs/study3", help="Run folder.")
    parser.add_argument("--page", type=Path, default=REPO / "docs/results/evidence3/runs.md")
    parser.add_argument("--aggregate-only", action="store_true", help="Only rewrite the table.")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands, run nothing.")
    parser.add_argument("--finish-by", metavar="HH:MM", help="Start no run expected to end later.")
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help="What outlives a machine.")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    print(f"[study3] {restore(out, args.archive)} finished runs restored from {args.archive}")
    if args.aggregate_only:
        write_table(out, args.page)
        return 0
    commit, src = pinned_source(out)
    stop = out / "STOP"
    for temperature, seed in anatomy_missing():
        if not stop.exists():
            argv = anatomy_command(temperature, seed)
            if args.dry_run:
                print(shlex.join(argv))
            else:
                run_logged(argv, out / f"anatomy-T{temperature}-seed{seed}.log", src)
    if not args.dry_run:
        test_finished(out, src, args.archive)
    while not stop.exists():
        todo = [r for r in planned(out) if finished(r, out) is None]
        if args.dry_run:
            for r in todo:
                print(shlex.join(train_command(r, out)))
            return 0
        if not todo:
            break
        run = next_run(todo, out, args.finish_by)
        if run is None:
            return 0
        execute(run, out, commit, src, argv=train_command(run, out))
        if finished(run, out) is None:  # it failed, or a signal stopped it
            write_table(out, args.page)
            print(f"[study3] {run.name} did not finish; rerun to resume it", flush=True)
            return 1
        keep(out, run.name, args.archive)
        test_finished(out, src, args.archive)  # its policy does not outlive this machine
        write_table(out, args.page)
    if stop.exists():
        print(f"[study3] {stop} exists: no more runs started", flush=True)
        return 0
    # Every training run has ended: the starting policy on the test split, and any run whose
    # test evaluation is missing: from its policy if it is still here, else trained again.
    test_policy("start", "smollm2-135m-instruct", out, src, args.archive)
    for r in planned(out):
        if r.group == "probe" or tested(r.name, out) or stop.exists():
            continue
        policy = out / r.name / "policy"
        if not policy.exists():
            if args.finish_by and expected_s(r, out) > seconds_until(args.finish_by):
                print(f"[study3] {r.name} would be trained again to test it; it would not "
                      f"end by {args.finish_by} UTC: not started", flush=True)  # fmt: skip
                return 0
            policy = retrain(r, out, commit, src, args.archive)
        if policy.exists():
            test_policy(r.name, str(policy), out, src, args.archive)
    write_table(out, args.page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
