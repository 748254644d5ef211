"""The third evidence round's rules (experiments/study3_plan.py, study3.py): the probe's lr, the
grid around it, each method's lr from training signals and the validation split only, and the
pre-registered verdict on the test split."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import study  # noqa: E402
import study3  # noqa: E402
import study3_plan as plan  # noqa: E402

pytestmark = pytest.mark.unit


def records(entropy_first: float, entropy_last: float, steps: int = 20, **extra) -> list[dict]:
    half = steps // 2
    return [
        {"step": i + 1, "entropy/mean": entropy_first if i < half else entropy_last,
         "learner/grad_norm": 1.0, **extra}
        for i in range(steps)
    ]  # fmt: skip


def test_entropy_ratio_is_last_ten_over_first_ten_and_needs_twenty_steps():
    assert plan.entropy_ratio(records(0.8, 0.4)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="needs 20"):
        plan.entropy_ratio(records(0.8, 0.4, steps=19))


def test_the_probe_takes_the_highest_stable_lr():
    runs = {"1e-5": records(0.8, 0.7), "3e-5": records(0.8, 0.5), "1e-4": records(0.8, 2.0)}
    best, why = plan.probe_lr(runs)
    assert best == "3e-5"  # 1e-4's entropy ratio 2.5 is outside [0.5, 2]
    assert "2.50" in why["1e-4"]
    runs["3e-5"][-1]["learner/grad_norm"] = math.inf
    assert plan.probe_lr(runs)[0] == "1e-5"
    runs["1e-5"] = records(0.8, 0.3)
    assert plan.probe_lr(runs)[0] is None


def test_the_grid_is_three_lrs_a_factor_three_apart_around_the_probe():
    assert plan.grid_lrs("3e-5") == ("1e-5", "3e-5", "1e-4")
    assert plan.grid_lrs("1e-4") == ("3e-5", "1e-4", "3e-4")
    assert plan.grid_lrs(None) == ("1e-6", "3e-6", "1e-5")  # none stable: below the probe
    lrs = [float(x) for x in plan.grid_lrs("1e-5")]
    assert all(2.5 < b / a < 3.5 for a, b in zip(lrs, lrs[1:], strict=False))


def grid_run(start: float, curve: list[float], ratio: float = 1.0):
    """(records, summary) of a 60-step run with validation at steps 20 and 40, then the end."""
    recs = records(1.0, ratio, steps=60)
    recs[19]["eval/pass@1"], recs[39]["eval/pass@1"] = curve[0], curve[1]
    return recs, {"eval_before": {"pass@1": start}, "eval_after": {"pass@1": curve[2]}}


def test_the_lr_rule_reads_the_last_two_validation_points_and_skips_broken_runs():
    runs = {
        "1e-5": grid_run(0.25, [0.25, 0.27, 0.29]),  # score 0.28
        "3e-5": grid_run(0.25, [0.30, 0.31, 0.33]),  # score 0.32: chosen
        "1e-4": grid_run(0.25, [0.40, 0.45, 0.50], ratio=3.5),  # best score, but broken
    }
    lr, why = plan.chosen_lr(runs)
    assert lr == "3e-5" and "broken" in why["1e-4"]
    # a run whose validation pass@1 falls more than 0.05 below the start at any point is broken
    runs["3e-5"] = grid_run(0.25, [0.19, 0.31, 0.33])
    assert plan.chosen_lr(runs)[0] == "1e-5"
    # ties go to the lower lr; all broken: the lowest lr
    runs["3e-5"] = grid_run(0.25, [0.25, 0.27, 0.29])
    assert plan.chosen_lr(runs)[0] == "1e-5"
    broken = {lr: grid_run(0.25, [0.1, 0.1, 0.1]) for lr in ("1e-5", "3e-5", "1e-4")}
    assert plan.chosen_lr(broken)[0] == "1e-5"


def test_the_final_evaluation_counts_once():
    # The runs evaluate every 20 steps, step 60 included, and once more at the end (the same
    # policy): the last two evaluations are those of steps 40 and 60.
    recs, summary = grid_run(0.25, [0.20, 0.30, 0.40])
    recs[59]["eval/pass@1"] = summary["eval_after"]["pass@1"]
    assert plan.validation_curve(recs, summary) == [0.20, 0.30, 0.40]
    other, other_summary = grid_run(0.25, [0.20, 0.36, 0.36])
    other[59]["eval/pass@1"] = other_summary["eval_after"]["pass@1"]
    lr, why = plan.chosen_lr({"1e-5": (recs, summary), "3e-5": (other, other_summary)})
    assert lr == "3e-5" and "score 0.350" in why["1e-5"] and "score 0.360" in why["3e-5"]


def test_run_settings_put_the_method_lr_and_seed_last():
    run = plan.run("grid", "cagrpo", "3e-5", 2)
    settings = run.settings()
    assert settings["algorithm.policy_loss"] == "cagrpo"
    assert settings["algorithm.lr"] == "3e-5" and settings["run.seed"] == "2"
    assert settings["run.steps"] == "60" and settings["rollout.temperature"] == "0.7"
    assert settings["data.eval_size"] == str(plan.VALIDATION_SIZE)


def write_run(out: Path, run: plan.Run, recs: list[dict], summary: dict) -> None:
    d = out / run.name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "summary.json").write_text(json.dumps(summary))


def test_the_plan_grows_as_runs_finish_and_the_verdict_follows_the_rule(tmp_path):
    assert [r.group for r in study3.planned(tmp_path)] == ["probe"] * 3
    for run, ratio in zip(plan.probe_runs(), (1.0, 1.0, 2.5), strict=True):
        write_run(tmp_path, run, records(1.0, ratio), {"eval_before": {"pass@1": 0.25}})
    made = study3.choices(tmp_path)
    assert made["probe_lr"] == "3e-5" and made["grid_lrs"] == ("1e-5", "3e-5", "1e-4")
    assert len(study3.planned(tmp_path)) == 3 + 6
    for run in plan.grid_runs("3e-5"):
        good = run.lr == "3e-5"
        write_run(tmp_path, run, *grid_run(0.25, [0.3, 0.3, 0.35 if good else 0.3]))
    made = study3.choices(tmp_path)
    assert made["chosen_lr"] == {"grpo": "3e-5", "cagrpo": "3e-5"}
    seeds = study3.planned(tmp_path)[9:]
    assert [(r.method, r.seed) for r in seeds] == [("grpo", 2), ("grpo", 3), ("cagrpo", 2),
                                                   ("cagrpo", 3)]  # fmt: skip
    for run in seeds:
        write_run(tmp_path, run, *grid_run(0.25, [0.3, 0.3, 0.3]))
    # the test split: CA-GRPO ahead by 0.05, 0.04 and 0.02 -> mean 0.037 >= 0.03, all > 0
    (tmp_path / "test").mkdir()
    test = {"grpo": {1: 0.30, 2: 0.31, 3: 0.29}, "cagrpo": {1: 0.35, 2: 0.35, 3: 0.31}}
    for run in [*plan.grid_runs("3e-5"), *seeds]:
        if run.lr == "3e-5":
            result = {"metrics": {"pass@1": test[run.method][run.seed]}}
            (tmp_path / "test" / f"{run.name}-T0.7.json").write_text(json.dumps(result))
    result = study3.verdict(tmp_path, study3.choices(tmp_path))
    assert result["verdict"] == "supports the paper"
    assert result["mean_d"] == pytest.approx((0.05 + 0.04 + 0.02) / 3)
    low, high = result["bootstrap_95"]
    assert 0.02 - 1e-9 <= low <= result["mean_d"] <= high <= 0.05 + 1e-9
    # CA-GRPO's entropy tripling in two seeds contradicts the paper, whatever the accuracy
    for run in seeds:
        if run.method == "cagrpo":
            (tmp_path / run.name / "metrics.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in grid_run(0.25, [0.3] * 3, ratio=2.5)[0])
            )
    assert study3.verdict(tmp_path, study3.choices(tmp_path))["verdict"] == "contradicts the paper"
    study3.write_table(tmp_path, tmp_path / "runs.md")
    table = (tmp_path / "runs.md").read_text()
    assert "probe-grpo-lr3e-5-s1" in table and "contradicts the paper" in table


def test_a_methods_lr_and_seeds_come_once_its_own_grid_has_finished(tmp_path):
    for run, ratio in zip(plan.probe_runs(), (1.0, 1.0, 2.5), strict=True):
        write_run(tmp_path, run, records(1.0, ratio), {"eval_before": {"pass@1": 0.25}})
    grid = plan.grid_runs("3e-5")
    for run in grid:  # CA-GRPO's three runs and two of GRPO's (GRPO's 1e-4 run still going)
        if not (run.method == "grpo" and run.lr == "1e-4"):
            write_run(tmp_path, run, *grid_run(0.25, [0.3, 0.3, 0.35 if run.lr == "3e-5" else 0.3]))
    made = study3.choices(tmp_path)
    assert made["chosen_lr"] == {"cagrpo": "3e-5"} and set(made["chosen_why"]) == {"cagrpo"}
    todo = [r for r in study3.planned(tmp_path) if study3.finished(r, tmp_path) is None]
    assert [(r.group, r.method, r.lr, r.seed) for r in todo] == [
        ("grid", "grpo", "1e-4", 1), ("seeds", "cagrpo", "3e-5", 2), ("seeds", "cagrpo", "3e-5", 3)
    ]  # fmt: skip
    assert study3.verdict(tmp_path, made) is None and not study3.all_finished(tmp_path, made)
    # GRPO's last grid run ends: its lr is chosen from its own runs, its seeds come first
    write_run(tmp_path, grid[2], *grid_run(0.25, [0.3, 0.3, 0.3]))
    made = study3.choices(tmp_path)
    assert made["chosen_lr"] == {"grpo": "3e-5", "cagrpo": "3e-5"}
    seeds = [(r.method, r.seed) for r in study3.planned(tmp_path) if r.group == "seeds"]
    assert seeds == [("grpo", 2), ("grpo", 3), ("cagrpo", 2), ("cagrpo", 3)]


def test_finished_runs_and_test_results_outlive_the_run_folder(tmp_path):
    out, archive, fresh = tmp_path / "out", tmp_path / "archive", tmp_path / "fresh"
    run = plan.probe_runs()[0]
    write_run(out, run, records(1.0, 1.0), {"eval_before": {"pass@1": 0.25}})
    (out / run.name / "policy").mkdir()  # too large to keep: stays behind
    (out / "SOURCE_COMMIT").write_text("abc\n")
    (out / "test").mkdir()
    (out / "test" / "start-T0.json").write_text(json.dumps({"metrics": {"pass@1": 0.2}}))
    study3.keep(out, run.name, archive)
    study3.keep(out, "test/start-T0.json", archive)
    assert sorted(p.name for p in (archive / run.name).iterdir()) == [
        "metrics.jsonl", "summary.json"]  # fmt: skip
    fresh.mkdir()
    assert study3.restore(fresh, archive) == 1
    assert study3.finished(run, fresh) == study3.finished(run, out)
    assert (fresh / "SOURCE_COMMIT").read_text() == "abc\n"
    assert study3.test_results(fresh) == {"start": {"T0": 0.2}}
    assert study3.restore(fresh, archive) == 0  # what is there already is left alone


def test_the_table_shows_the_test_split_only_once_every_run_has_finished(tmp_path):
    for run in plan.probe_runs():
        write_run(tmp_path, run, records(1.0, 1.0), {"eval_before": {"pass@1": 0.25}})
    grid = plan.grid_runs(plan.PROBE_LRS[-1])
    write_run(tmp_path, grid[0], *grid_run(0.25, [0.3, 0.3, 0.3]))
    (tmp_path / "test").mkdir()
    result = {"metrics": {"pass@1": 0.375}}
    (tmp_path / "test" / f"{grid[0].name}-T0.7.json").write_text(json.dumps(result))
    study3.write_table(tmp_path, tmp_path / "runs.md")
    table = (tmp_path / "runs.md").read_text()
    assert "not finished" in table and "0.375" not in table and "Verdict" not in table
    # the figure of the finished grid run beside it, the same without the test split
    assert f"]({study3.FIGURE})" in table
    drawn = (tmp_path / study3.FIGURE).read_bytes()
    shutil.rmtree(tmp_path / "test")
    study3.write_table(tmp_path, tmp_path / "runs.md")
    assert (tmp_path / study3.FIGURE).read_bytes() == drawn


def test_a_run_starts_only_if_it_is_expected_to_end_in_time(tmp_path):
    from datetime import UTC, datetime

    probe, grid = plan.probe_runs()[0], plan.grid_runs("3e-5")[0]
    # no run has finished here: the defaults, and the test evaluation only after grid runs
    assert study3.expected_s(probe, tmp_path) == 20 * study3.STEP_S
    assert study3.expected_s(grid, tmp_path) == 60 * study3.STEP_S + study3.TEST_S
    (tmp_path / probe.name).mkdir()
    provenance = {"overrides": probe.settings(), "wall_s": 1200.0, "returncode": 0}
    (tmp_path / probe.name / "provenance.json").write_text(json.dumps(provenance))
    assert study3.expected_s(grid, tmp_path) == 60 * 60.0 + study3.TEST_S
    now = datetime(2026, 12, 1, 20, 30, 15, tzinfo=UTC)
    assert study3.seconds_until("21:00", now) == 29 * 60 + 45
    assert study3.seconds_until("20:00", now) < 0
    assert study3.seconds_until("01:00", now) == (4 * 60 + 29) * 60 + 45  # after midnight


def test_a_run_is_timed_by_its_own_method_and_lr_and_a_long_one_waits(tmp_path, monkeypatch):
    def finish(run, wall_s):
        (tmp_path / run.name).mkdir()
        provenance = {"overrides": run.settings(), "wall_s": wall_s, "returncode": 0}
        (tmp_path / run.name / "provenance.json").write_text(json.dumps(provenance))

    slow, quick, other = plan.probe_runs()[2], plan.probe_runs()[0], plan.probe_runs()[1]
    finish(slow, 20 * 150.0)  # GRPO 1e-4: 150 s a step
    finish(quick, 20 * 30.0)
    finish(other, 20 * 60.0)
    grpo_1e4 = plan.run("grid", "grpo", "1e-4", 1)
    cagrpo_1e5 = plan.run("grid", "cagrpo", "1e-5", 1)
    assert study3.expected_s(grpo_1e4, tmp_path) == 60 * 150.0 + study3.TEST_S
    assert study3.expected_s(cagrpo_1e5, tmp_path) == 60 * 60.0 + study3.TEST_S  # the median
    for left_s, want in [(3 * 3600, grpo_1e4), (60 * 60 + study3.TEST_S, cagrpo_1e5), (600, None)]:
        monkeypatch.setattr(study3, "seconds_until", lambda clock, left_s=left_s: left_s)
        assert study3.next_run([grpo_1e4, cagrpo_1e5], tmp_path, "15:00") == want
    assert study3.next_run([grpo_1e4, cagrpo_1e5], tmp_path, None) == grpo_1e4


def test_a_resumed_runs_pace_counts_every_attempts_steps(tmp_path):
    """Its provenance holds the last attempt's wall time only; its metrics hold every step's."""
    run = plan.run("grid", "cagrpo", "1e-5", 1)
    (tmp_path / run.name).mkdir()
    provenance = {"overrides": run.settings(), "wall_s": 10 * 70.0, "returncode": 0}
    (tmp_path / run.name / "provenance.json").write_text(json.dumps(provenance))
    seconds = [60.0 + i for i in range(60)]  # steps 1-50 trained before the resume, 51-60 after
    lines = [json.dumps({"step": i + 1, "time/step": t}) for i, t in enumerate(seconds)]
    (tmp_path / run.name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    seeds = plan.run("seeds", "cagrpo", "1e-5", 2)
    # 60 steps at the metrics' mean pace, not at 70 s (the last attempt's 10 steps)
    assert study3.expected_s(seeds, tmp_path) == pytest.approx(sum(seconds) + study3.TEST_S)
    # an unresumed run's wall time, which also holds its start and evaluations, is larger
    provenance["wall_s"] = sum(seconds) + 600.0
    (tmp_path / run.name / "provenance.json").write_text(json.dumps(provenance))
    want = sum(seconds) + 600.0 + study3.TEST_S
    assert study3.expected_s(seeds, tmp_path) == pytest.approx(want)


def test_the_anatomy_runs_only_the_batches_not_measured_yet(tmp_path):
    assert len(study3.anatomy_missing(tmp_path)) == 4
    (tmp_path / "anatomy-smollm2-T0.7.json").write_text("{}")  # both seeds in one file
    (tmp_path / "anatomy-smollm2-T1-seed0.json").write_text("{}")
    assert study3.anatomy_missing(tmp_path) == [("1", "1")]
    argv = study3.anatomy_command("1", "1", tmp_path)
    assert argv[argv.index("--seeds") + 1 :][:2] == ["1", "--chunk-rows"]
    assert argv[-1].endswith("anatomy-smollm2-T1-seed1.json")


def test_a_resumed_run_takes_its_step0_evaluation_from_its_first_attempts_log(tmp_path):
    run = plan.grid_runs("3e-5")[0]
    recs, summary = grid_run(0.25, [0.3, 0.3, 0.3])
    del summary["eval_before"]  # the pinned trainer evaluates step 0 in a first attempt only
    write_run(tmp_path, run, recs, summary)
    assert "eval_before" not in study3.finished(run, tmp_path)[1]
    (tmp_path / f"{run.name}.log").write_text(
        "INFO step 1 ...\n"
        "2026-12-02 04:01:02 INFO cagrpo_ray: eval (before, step 0): pass@1=0.148, "
        "T0/pass@1=0.172, mean_response_tokens=94.219\n"
        "INFO eval (step 20): pass@1=0.156\n"
    )
    before = study3.finished(run, tmp_path)[1]["eval_before"]
    assert before["pass@1"] == 0.148 and before["T0/pass@1"] == 0.172
    assert before["mean_response_tokens"] == 94.219 and "log" in before["source"]
    (tmp_path / f"{run.name}.log").unlink()  # kept in the run's folder, and so in the archive
    assert study3.finished(run, tmp_path)[1]["eval_before"] == before


def test_a_run_stopped_by_a_signal_is_not_finished(tmp_path):
    # `kill -TERM` of a run: the trainer checkpoints, saves its policy and writes a summary
    # with `stopped_at`; the run must resume, not be kept, tested or read by a rule.
    run = plan.grid_runs("3e-5")[0]
    recs, summary = grid_run(0.25, [0.3, 0.3, 0.3])
    write_run(tmp_path, run, recs[:11], {**summary, "stopped_at": 11, "final_step": 11})
    assert study3.finished(run, tmp_path) is None
    (tmp_path / run.name / "summary.json").write_text(json.dumps({**summary, "final_step": 60}))
    assert study3.finished(run, tmp_path) is not None


def test_the_shared_runner_resumes_a_stopped_run_and_skips_only_a_finished_one(
    tmp_path, monkeypatch
):
    # The runner (study.execute) used to skip any run with a summary, so a run a signal had
    # stopped was reported "done already" and never resumed.
    run = plan.grid_runs("1e-5")[0]
    recs, summary = grid_run(0.25, [0.3, 0.3, 0.3])
    write_run(tmp_path, run, recs[:12], {**summary, "stopped_at": 12, "final_step": 12})
    (tmp_path / run.name / "checkpoints" / "latest").mkdir(parents=True)
    started = []

    def fake_run(argv, **kwargs):
        started.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    monkeypatch.setattr(study, "machine", lambda: {})
    argv = study3.train_command(run, tmp_path)
    study.execute(run, tmp_path, "abc", tmp_path, argv=argv)
    assert started == [argv] and argv[-1] == "--resume"
    (tmp_path / run.name / "summary.json").write_text(json.dumps({**summary, "final_step": 60}))
    study.execute(run, tmp_path, "abc", tmp_path, argv=argv)
    assert len(started) == 1  # finished: not started again


def test_reproduction_finds_the_first_step_two_runs_differ():
    kept = records(1.0, 0.5, **{"reward/mean": 0.25})
    assert study3.reproduction(kept, [dict(r) for r in kept])["first_differing_step"] is None
    new = [dict(r) for r in kept]
    new[6]["entropy/mean"] += 0.125
    new[9]["reward/mean"] -= 0.5
    found = study3.reproduction(kept, new)
    assert found["first_differing_step"] == 7 and found["steps_compared"] == 20
    assert found["max_abs_diff"]["entropy/mean"] == pytest.approx(0.125)
    assert found["max_abs_diff"]["reward/mean"] == pytest.approx(0.5)


def test_a_run_whose_policy_was_lost_untested_is_trained_again_then_tested(tmp_path, monkeypatch):
    out, archive = tmp_path / "out", tmp_path / "archive"
    for run, ratio in zip(plan.probe_runs(), (1.0, 1.0, 2.5), strict=True):
        write_run(out, run, records(1.0, ratio), {"eval_before": {"pass@1": 0.25}})
    runs = plan.grid_runs("3e-5")
    for run in runs:
        write_run(out, run, *grid_run(0.25, [0.3, 0.3, 0.35 if run.lr == "3e-5" else 0.3]))
        (out / run.name / "policy").mkdir()
    runs += plan.seed_runs(study3.choices(out)["chosen_lr"])
    for run in runs[6:]:
        write_run(out, run, *grid_run(0.25, [0.3, 0.3, 0.3]))
        (out / run.name / "policy").mkdir()
    lost = runs[0]
    (out / lost.name / "policy").rmdir()  # its machine ended before its test evaluation
    trained, tested = [], []

    def execute(run, folder, commit, src, argv):  # the training: the kept run, one step off
        trained.append((run.name, folder.name, "--resume" in argv))
        recs, summary = grid_run(0.25, [0.3, 0.3, 0.3])
        recs[41]["entropy/mean"] += 0.01
        write_run(folder, run, recs, summary)
        (folder / run.name / "policy").mkdir()

    def run_logged(argv, log, src):  # the test evaluation
        tested.append(argv[argv.index("--model") + 1])
        result = Path(argv[argv.index("--out") + 1])
        result.write_text(json.dumps({"metrics": {"pass@1": 0.3}}))
        return 0

    monkeypatch.setattr(study3, "execute", execute)
    monkeypatch.setattr(study3, "run_logged", run_logged)
    monkeypatch.setattr(study3, "pinned_source", lambda out: ("abc", out))
    monkeypatch.setattr(study3, "anatomy_missing", lambda: [])
    page = tmp_path / "runs.md"
    assert study3.main(["--out", str(out), "--page", str(page), "--archive", str(archive)]) == 0
    assert trained == [(lost.name, "retrain", False)]  # only the run with no policy
    assert str(out / "retrain" / lost.name / "policy") in tested
    assert len(tested) == 2 * (1 + len(runs))  # the start and every run, at both settings
    reproduced = json.loads((archive / lost.name / "reproduced.json").read_text())
    assert reproduced["first_differing_step"] == 42
    assert f"{lost.name} (trained again for its test: differs from step 42)" in page.read_text()
    assert "Verdict" in page.read_text()


def test_a_finished_runs_test_gets_absolute_paths_and_is_retried_on_the_next_start(
    tmp_path, monkeypatch
):
    # The evaluation runs in the pinned snapshot's folder: relative paths would name nothing.
    monkeypatch.chdir(tmp_path)
    out = Path("out")
    for run, ratio in zip(plan.probe_runs(), (1.0, 1.0, 2.5), strict=True):
        write_run(out, run, records(1.0, ratio), {"eval_before": {"pass@1": 0.25}})
    grid = plan.grid_runs("3e-5")
    write_run(out, grid[0], *grid_run(0.25, [0.3, 0.3, 0.3]))
    (out / grid[0].name / "policy").mkdir()
    calls = []

    def run_logged(argv, log, src):
        calls.append(argv)
        return 1  # the evaluation failed: no result written

    monkeypatch.setattr(study3, "run_logged", run_logged)
    study3.test_finished(out, tmp_path / "src", tmp_path / "archive")
    assert len(calls) == 2  # both settings of the one finished grid run
    for argv in calls:
        model, result = argv[argv.index("--model") + 1], argv[argv.index("--out") + 1]
        assert (
            model == str((out / grid[0].name / "policy").resolve()) and Path(result).is_absolute()
        )
    assert not study3.tested(grid[0].name, out)
    calls.clear()
    study3.test_finished(out, tmp_path / "src", tmp_path / "archive")  # tried again
    assert len(calls) == 2
