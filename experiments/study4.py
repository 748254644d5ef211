"""The fourth evidence round: round 3's comparison at the lower lrs, tested also on prompts drawn
like the training prompts, every test sample kept.

One resumable command runs the plan of `docs/results/evidence4.md` (`study4_plan.py`):

    .venv/bin/python experiments/study4.py --out runs/study4

Training runs execute round 3's pinned commit (`docs/results/evidence3/kept/SOURCE_COMMIT`),
with round 3's settings and run names, so that round 3's finished runs (restored from its
archive) are members of round 4's grid and seeds. Stages: GRPO and CA-GRPO at 3e-6 (and at
1e-6 if 3e-6 is either method's choice); seeds 2 and 3 at each method's chosen lr; then the
starting policy and every policy the verdict reads on both test splits (`study4_eval.py`,
every sample kept). A new run's policy is tested as soon as it finishes (a policy does not
outlive its machine); a verdict run whose policy is gone (round 3's, or one trained on an
earlier machine) is trained again from the same commit into `<out>/retrain/` and tested,
with `reproduced.json` saying whether it matched the kept run step by step.

As round 3: a finished run is skipped, a stopped one resumes from its newest checkpoint;
`touch <out>/STOP` ends the study after the current run; `--finish-by HH:MM` (UTC) starts
only what is expected to end by then; `--dry-run` prints the commands; `--aggregate-only`
rewrites the table, `docs/results/evidence4/runs.md` (`<out>/runs.md` for another `--out`).
What outlives a machine goes to `docs/results/evidence4/kept/` (committed). Run it only when
the machine is otherwise idle.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import statistics
from pathlib import Path

import study3
import study4_plan as plan
import study4_plots
from study import execute, pinned_source

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = REPO / "docs/results/evidence4"
ARCHIVE = EVIDENCE / "kept"
ROUND3_ARCHIVE = study3.ARCHIVE
TEST2_FILE = EVIDENCE / "test2.jsonl"  # the second test split, fixed with the plan
OUT = REPO / "runs/study4"  # the study's run folder, whose table is the committed page
TESTS = "test4"  # the folder of round 4's test results (round 3's are in test/)
FIGURE = "tests.png"  # beside the page: every tested policy's pass@1 by lr
COLUMNS = [(split, setting) for split, settings in plan.TEST_SETTINGS.items()
           for setting in settings]  # fmt: skip


def restore(out: Path, archive: Path = ARCHIVE, round3_archive: Path = ROUND3_ARCHIVE) -> int:
    """Round 3's finished runs and pinned commit, then round 4's own archive (its test
    results and samples included), into `out` where it lacks them."""
    brought = study3.restore(out, round3_archive) + study3.restore(out, archive)
    for result in sorted((archive / TESTS).glob("*")) if (archive / TESTS).exists() else []:
        if not (out / TESTS / result.name).exists():
            (out / TESTS).mkdir(parents=True, exist_ok=True)
            (out / TESTS / result.name).write_bytes(result.read_bytes())
    return brought


def keep_test(out: Path, name: str, archive: Path = ARCHIVE) -> None:
    (archive / TESTS).mkdir(parents=True, exist_ok=True)
    (archive / TESTS / name).write_bytes((out / TESTS / name).read_bytes())


def choose(out: Path, lrs) -> tuple[dict[str, str], dict[str, dict]]:
    """Each method's lr by round 3's rule over `lrs`, for the methods whose runs at every one
    of `lrs` have finished, and why."""
    chosen, why = {}, {}
    for method in plan.METHODS:
        runs = {r.lr: study3.finished(r, out) for r in plan.grid_runs(lrs) if r.method == method}
        if all(runs.values()):
            chosen[method], why[method] = plan.chosen_lr(runs)
    return chosen, why


def choices(out: Path) -> dict:
    """The grid and what the rule chose so far: the choice over the first grid decides
    whether 1e-6 joins; a method's final lr is its choice over the final grid."""
    first, _ = choose(out, plan.FIRST_GRID)
    lrs, settled = plan.grid_lrs(first)
    made: dict = {"first_choices": first, "grid_lrs": list(lrs), "grid_final": settled}
    if settled:
        chosen, why = choose(out, lrs)
        made.update(chosen_lr=chosen, chosen_why=why)
    return made


def planned(out: Path) -> list:
    """Every run of the plan so far, in order (round 3's among them, finished already)."""
    made = choices(out)
    runs = plan.grid_runs(made["grid_lrs"])
    runs += plan.seed_runs(made.get("chosen_lr", {}))
    return runs


def untested(out: Path) -> list[str]:
    """The finished runs of the plan whose policy is on this machine and lacks a test result
    (its test failed, or a stop cut it short): tested before the next run trains, as a policy
    does not outlive its machine."""
    return [
        r.name
        for r in planned(out)
        if (out / r.name / "policy").exists()
        and not tested(r.name, out)
        and study3.finished(r, out) is not None
    ]


def every_lr_chosen(made: dict) -> bool:
    return set(made.get("chosen_lr", {})) == set(plan.METHODS)


def result_name(policy: str, split: str, setting: str) -> str:
    return f"{policy}-{split}-{setting}"


def test_command(model: str, name: str, split: str, setting: str, out: Path) -> list[str]:
    """The evaluation of policy `name` (its folder or preset `model`) on one split at one
    setting, every sample kept: `<out>/test4/<name>-<split>-<setting>.json` and
    `.samples.jsonl.gz`."""
    config = study3.load_config(REPO / plan.CONFIG)
    temperature, samples = plan.TEST_SETTINGS[split][setting]
    stem = str((out / TESTS / result_name(name, split, setting)).resolve())
    if split == "test1":
        data = ["--data", study3.test_source(), "--offset", str(plan.VALIDATION_SIZE),
                "--limit", str(plan.TEST1_SIZE)]  # fmt: skip
    else:
        data = ["--data", str(TEST2_FILE.resolve()), "--question-column", "question"]
    return study3._locked(
        study3.PYTHON, str(REPO / "experiments/study4_eval.py"),
        "--samples-out", stem + ".samples.jsonl.gz", "--",
        "--model", model, *data, "--samples", samples, "--temperature", temperature,
        "--max-tokens", str(config.rollout.max_tokens),
        "--max-model-len", str(config.rollout.max_model_len),
        "--weights", json.dumps(config.reward.weights),
        "--instruction", config.data.instruction, "--seed", "0", "--out", stem + ".json",
    )  # fmt: skip


def tested(name: str, out: Path) -> bool:
    return all(
        (out / TESTS / f"{result_name(name, split, setting)}.samples.jsonl.gz").exists()
        for split, settings in plan.TEST_SETTINGS.items()
        for setting in settings
    )


def test_policy(name: str, model: str, out: Path, src: Path, archive: Path = ARCHIVE) -> None:
    """Both splits at both settings on one policy (`name`'s results), what it lacks, kept."""
    (out / TESTS).mkdir(parents=True, exist_ok=True)
    if Path(model).exists():
        model = str(Path(model).resolve())
    for split, settings in plan.TEST_SETTINGS.items():
        for setting in settings:
            stem = result_name(name, split, setting)
            if (out / TESTS / f"{stem}.samples.jsonl.gz").exists():
                continue
            argv = test_command(model, name, split, setting, out)
            rc = study3.run_logged(argv, out / TESTS / f"{stem}.log", src)
            if (out / TESTS / f"{stem}.samples.jsonl.gz").exists():
                keep_test(out, f"{stem}.json", archive)
                keep_test(out, f"{stem}.samples.jsonl.gz", archive)
            else:
                print(f"[study4] {stem} FAILED (rc {rc}); the next start tries it again",
                      flush=True)  # fmt: skip


def samples(out: Path, name: str, split: str, setting: str) -> list[dict] | None:
    path = out / TESTS / f"{result_name(name, split, setting)}.samples.jsonl.gz"
    if not path.exists():
        return None
    with gzip.open(path, "rt") as handle:
        return [json.loads(line) for line in handle]


def verdict(out: Path, made: dict, split: str = plan.PRIMARY[0], setting: str = plan.PRIMARY[1]):
    """The rule (`study4_plan.verdict`) on one split and setting, once every verdict run has
    its samples there; with each seed's paired standard error over prompts."""
    if not every_lr_chosen(made):
        return None
    by: dict = {}
    for r in plan.verdict_runs(made["chosen_lr"]):
        kept = samples(out, r.name, split, setting)
        if kept is None:
            return None
        per_prompt: dict[str, list[bool]] = {}
        for s in kept:
            per_prompt.setdefault(s["uid"], []).append(s["correct"])
        by[(r.method, r.seed)] = {u: statistics.fmean(v) for u, v in per_prompt.items()}
    seeds = (1, *plan.SEEDS)
    d, se = [], []
    for seed in seeds:
        grpo, cagrpo = by[("grpo", seed)], by[("cagrpo", seed)]
        diffs = [cagrpo[u] - grpo[u] for u in grpo]
        d.append(statistics.fmean(diffs))
        se.append(plan.paired_se(diffs))
    return {**plan.verdict(d), "paired_se": se, "split": split, "setting": setting}


def sample_tables(out: Path, made: dict) -> dict[str, dict[tuple[str, str], dict]]:
    """Each tested policy's `sample_table` per split and setting, read once for the page: the
    starting policy, then the plan's runs in order (the verdict's among them)."""
    names = ["start", *(r.name for r in planned(out))]
    names += [r.name for r in plan.verdict_runs(made.get("chosen_lr", {}))]
    tables: dict[str, dict[tuple[str, str], dict]] = {}
    for name in dict.fromkeys(names):
        for split, setting in COLUMNS:
            kept = samples(out, name, split, setting)
            if kept is not None:
                tables.setdefault(name, {})[(split, setting)] = plan.sample_table(kept)
    return tables


def tests_so_far(tables: dict[str, dict[tuple[str, str], dict]]) -> list[str]:
    """A row per policy with any test result (`sample_tables`): pass@1 and the share of
    responses cut at the cap, per split and setting, as each result comes in."""
    rows = []
    for name, results in tables.items():
        cells = [
            f"{t['pass@1']:.3f} (cut {100 * t['truncated']:.1f}%)" if (t := results.get(c)) else ""
            for c in COLUMNS
        ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    head = " | ".join(f"{split} {setting}" for split, setting in COLUMNS)
    return [
        "## Tests so far: pass@1 (share of responses cut at the token cap)", "",
        f"| policy | {head} |", "|---|" + "---|" * len(COLUMNS), *rows, "",
    ]  # fmt: skip


def test_points(
    out: Path, made: dict, tables: dict[str, dict[tuple[str, str], dict]]
) -> dict[tuple[str, str], list[dict]]:
    """Every tested policy's pass@1 (`sample_tables`) on each split and setting, for the
    figure: the starting policy (method "start") and each run of the plan with its method, lr
    and seed."""
    runs = {r.name: r for r in [*planned(out), *plan.verdict_runs(made.get("chosen_lr", {}))]}
    points: dict[tuple[str, str], list[dict]] = {}
    for column in COLUMNS:
        rows = []
        for name, results in tables.items():
            if column not in results:
                continue
            run = runs.get(name)
            rows.append({
                "name": name,
                "method": run.method if run else "start",
                "lr": run.lr if run else None,
                "seed": run.seed if run else None,
                "pass@1": results[column]["pass@1"],
            })  # fmt: skip
        if rows:
            points[column] = rows
    return points


def rule_table(rules: list[dict]) -> list[str]:
    """The rule on every split and setting, one row each: d = CA-GRPO minus GRPO in pass@1 per
    seed (its paired standard error over prompts), the mean, the t-interval, the sign test."""
    lines = ["## The rule on every split and setting (d = CA-GRPO minus GRPO, pass@1)", "",
             "| split, setting | d per seed (paired SE) | mean d | 95% t-interval | sign p "
             "| label |", "|---|---|---|---|---|---|"]  # fmt: skip
    for rule in rules:
        pairs = zip(rule["d"], rule["paired_se"], strict=True)
        seeds = ", ".join(f"{d:+.3f} ({se:.3f})" for d, se in pairs)
        low, high = rule["t95"]
        lines.append(
            f"| {rule['split']}, {rule['setting']} | {seeds} | {rule['mean_d']:+.3f} | "
            f"{low:+.3f} to {high:+.3f}{'' if rule['t95_excludes_0'] else ' (holds 0)'} | "
            f"{rule['sign_test_p']:.3f} | {rule['label']} |"
        )
    return [*lines, ""]


def write_table(out: Path, page: Path) -> None:
    """The runs so far, the rule's choices and, once the verdict's runs are all tested, each
    policy's test tables and the verdict on both splits."""
    made = choices(out)
    lines = ["# Evidence, round 4: the runs (written by experiments/study4.py)", ""]
    lines += ["| run | steps | entropy ratio | validation pass@1 T=0.7 (start -> evals) |"]
    lines += ["|---|---|---|---|"]
    for r in planned(out):
        done = study3.finished(r, out)
        if done is None:
            lines.append(f"| {r.name} | not finished | | |")
            continue
        records, summary = done
        curve = " / ".join(f"{v:.3f}" for v in plan.round3.validation_curve(records, summary))
        lines.append(
            f"| {r.name} | {len(records)} | {plan.round3.entropy_ratio(records):.2f} | "
            f"{summary['eval_before']['pass@1']:.3f} -> {curve} |"
        )
    lines += ["", "Choices: `" + json.dumps(made) + "`", ""]
    tables = sample_tables(out, made)
    lines += tests_so_far(tables)
    if points := test_points(out, made, tables):
        study4_plots.draw(points, made.get("chosen_lr", {}), page.parent / FIGURE)
        lines += [f"![every tested policy's pass@1 by lr, per split and setting]({FIGURE})", ""]
    primary = verdict(out, made)
    if primary is not None:
        names = ["start"] + [r.name for r in plan.verdict_runs(made["chosen_lr"])]
        rules = []
        for split, settings in plan.TEST_SETTINGS.items():
            for setting in settings:
                lines += [f"## {split}, {setting}", "", "| policy | table |", "|---|---|"]
                for name in names:
                    table = tables.get(name, {}).get((split, setting), "missing")
                    lines.append(f"| {name} | `{json.dumps(table)}` |")
                rules.append(verdict(out, made, split, setting))
                lines += ["", f"Rule on {split}, {setting}: `" + json.dumps(rules[-1]) + "`", ""]
        lines += rule_table(rules)
        lines += ["Verdict (test2, T=0.7): `" + json.dumps(primary) + "`"]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")
    (out / "choices.json").write_text(json.dumps(made, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT, help="Run folder.")
    parser.add_argument(
        "--page", type=Path,
        help="The table: the committed one for the default --out, else <out>/runs.md.",
    )  # fmt: skip
    parser.add_argument("--aggregate-only", action="store_true", help="Only rewrite the table.")
    parser.add_argument("--dry-run", action="store_true", help="Print the commands, run nothing.")
    parser.add_argument("--finish-by", metavar="HH:MM", help="Start no run expected to end later.")
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help="What outlives a machine.")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    page = args.page or (EVIDENCE / "runs.md" if out.resolve() == OUT else out / "runs.md")
    print(f"[study4] {restore(out, args.archive)} finished runs restored", flush=True)
    if args.aggregate_only:
        write_table(out, page)
        return 0
    if not TEST2_FILE.exists():
        raise SystemExit(f"{TEST2_FILE} is missing: it is fixed with the plan, not rebuilt")
    commit, src = pinned_source(out)  # round 3's commit, restored with its runs
    stop = out / "STOP"
    while not stop.exists():
        todo = [r for r in planned(out) if study3.finished(r, out) is None]
        if args.dry_run:
            for r in todo:
                print(shlex.join(study3.train_command(r, out)))
            return 0
        for name in untested(out):
            test_policy(name, str(out / name / "policy"), out, src, args.archive)
            write_table(out, page)
        if not todo:
            break
        run = study3.next_run(todo, out, args.finish_by)
        if run is None:
            return 0
        execute(run, out, commit, src, argv=study3.train_command(run, out))
        if study3.finished(run, out) is None:
            write_table(out, page)
            print(f"[study4] {run.name} did not finish; rerun to resume it", flush=True)
            return 1
        study3.keep(out, run.name, args.archive)
        test_policy(run.name, str(out / run.name / "policy"), out, src, args.archive)
        write_table(out, page)
    if stop.exists():
        print(f"[study4] {stop} exists: no more runs started", flush=True)
        return 0
    made = choices(out)
    test_policy("start", "smollm2-135m-instruct", out, src, args.archive)
    for r in plan.verdict_runs(made.get("chosen_lr", {})):
        if tested(r.name, out) or stop.exists():
            continue
        policy = out / r.name / "policy"
        if not policy.exists():
            if args.finish_by and study3.expected_s(r, out) > study3.seconds_until(args.finish_by):
                print(f"[study4] {r.name} would be trained again to test it; it would not "
                      f"end by {args.finish_by} UTC: not started", flush=True)  # fmt: skip
                break  # to the page's rewrite below: the tests made before this stop reach it
            policy = study3.retrain(r, out, commit, src, args.archive)
        if policy.exists():
            test_policy(r.name, str(policy), out, src, args.archive)
    write_table(out, page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
