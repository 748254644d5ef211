"""The fourth evidence round's plan (experiments/study4_plan.py, study4.py, study4_eval.py),
checked without running a model: the grid extended downward with round 3's rule and runs, the
second test split fixed with the plan, the mirrored decision rule and its statistics, and the
per-sample records."""

import itertools
import json
import math
import random
import statistics
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import study3  # noqa: E402
import study4  # noqa: E402
import study4_eval  # noqa: E402
import study4_plan as plan  # noqa: E402
from test_study3_plan import grid_run, write_run  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_grid_extends_downward_and_reaches_1e6_only_if_3e6_is_chosen():
    assert plan.FIRST_GRID == ("3e-6", "1e-5", "3e-5", "1e-4")
    assert plan.grid_lrs({}) == (plan.FIRST_GRID, False)
    assert plan.grid_lrs({"grpo": "1e-5"}) == (plan.FIRST_GRID, False)  # CA-GRPO not chosen yet
    assert plan.grid_lrs({"grpo": "1e-5", "cagrpo": "1e-5"}) == (plan.FIRST_GRID, True)
    for first in ({"cagrpo": "3e-6"}, {"grpo": "3e-6", "cagrpo": "1e-5"}):
        lrs, final = plan.grid_lrs(first)
        assert final and lrs == ("1e-6", *plan.FIRST_GRID)
    assert plan.SEEDS == (2, 3) and plan.chosen_lr is plan.round3.chosen_lr


def test_round3s_runs_are_round4s_own_with_the_same_settings():
    """Round 4 trains round 3's pinned commit with round 3's settings: its kept runs at 1e-5,
    3e-5 and 1e-4 are members of the grid and the seeds, command for command."""
    kept = study3.ARCHIVE
    runs = plan.grid_runs(plan.round3.grid_lrs("3e-5")) + plan.seed_runs(
        {"grpo": "1e-5", "cagrpo": "1e-5"}
    )
    assert len(runs) == 10
    for run in runs:
        provenance = json.loads((kept / run.name / "provenance.json").read_text())
        assert provenance["overrides"] == run.settings()
        assert provenance["source_commit"] == (kept / "SOURCE_COMMIT").read_text().strip()
        assert run.settings()["run.steps"] == "60"


def test_the_study_plans_the_3e6_runs_first_then_chooses_with_round3s_rule(tmp_path):
    out, archive = tmp_path / "out", tmp_path / "archive"
    out.mkdir()
    assert study4.restore(out, archive) == 13  # round 3's probe, grid and seed runs
    made = study4.choices(out)
    assert made["first_choices"] == {} and not made["grid_final"]
    todo = [r for r in study4.planned(out) if study3.finished(r, out) is None]
    assert [r.name for r in todo] == ["grid-grpo-lr3e-6-s1", "grid-cagrpo-lr3e-6-s1"]
    # GRPO's 3e-6 run below its 1e-5 score, CA-GRPO's unbroken (round 3's three are broken)
    write_run(out, todo[0], *grid_run(0.148, [0.15, 0.16, 0.17]))
    write_run(out, todo[1], *grid_run(0.148, [0.15, 0.16, 0.17]))
    made = study4.choices(out)
    assert made["first_choices"] == {"grpo": "1e-5", "cagrpo": "3e-6"}
    assert made["grid_lrs"][0] == "1e-6" and made["chosen_lr"] == {}  # 1e-6 not run yet
    todo = [r.name for r in study4.planned(out) if study3.finished(r, out) is None]
    assert todo == ["grid-grpo-lr1e-6-s1", "grid-cagrpo-lr1e-6-s1"]
    for run in plan.grid_runs(["1e-6"]):
        write_run(out, run, *grid_run(0.148, [0.15, 0.15, 0.15]))
    made = study4.choices(out)
    assert made["chosen_lr"] == {"grpo": "1e-5", "cagrpo": "3e-6"}
    todo = [r.name for r in study4.planned(out) if study3.finished(r, out) is None]
    assert todo == ["seeds-cagrpo-lr3e-6-s2", "seeds-cagrpo-lr3e-6-s3"]  # GRPO's are round 3's
    verdict_runs = [r.name for r in plan.verdict_runs(made["chosen_lr"])]
    assert verdict_runs[:3] == [
        "grid-grpo-lr1e-5-s1", "seeds-grpo-lr1e-5-s2", "seeds-grpo-lr1e-5-s3"]  # fmt: skip


def test_a_finished_run_whose_policy_lacks_a_test_is_tested_before_the_next_run(tmp_path):
    """A test that failed, or one a stop cut short, is taken up at the next start while the
    policy is here; round 3's restored runs (no policy) and an unfinished run are not."""
    out = tmp_path / "out"
    out.mkdir()
    study4.restore(out, tmp_path / "archive")
    grpo, cagrpo = plan.grid_runs(["3e-6"])
    write_run(out, grpo, *grid_run(0.148, [0.15, 0.16, 0.17]))
    assert study4.untested(out) == []  # finished, but its policy is not here
    for run in (grpo, cagrpo):
        (out / run.name / "policy").mkdir(parents=True)
    assert study4.untested(out) == [grpo.name]  # CA-GRPO's run has not finished
    (out / study4.TESTS).mkdir()
    names = [study4.result_name(grpo.name, split, setting)
             for split, settings in plan.TEST_SETTINGS.items() for setting in settings]  # fmt: skip
    for name in names[:-1]:
        (out / study4.TESTS / f"{name}.samples.jsonl.gz").touch()
    assert study4.untested(out) == [grpo.name]  # one of its four results is missing
    (out / study4.TESTS / f"{names[-1]}.samples.jsonl.gz").touch()
    assert study4.untested(out) == []


def test_cagrpos_three_broken_round3_runs_make_the_1e6_runs_certain(tmp_path):
    """Round 3's rule takes the lowest lr when every run is broken and the best unbroken one
    otherwise; CA-GRPO's runs at 1e-5, 3e-5 and 1e-4 are all broken, so it chooses 3e-6
    whatever its 3e-6 run does, and 1e-6 joins the grid."""
    for validation in ([0.04, 0.05, 0.06], [0.15, 0.16, 0.17]):  # broken, unbroken
        out = tmp_path / f"out{validation[0]}"
        out.mkdir()
        study4.restore(out, tmp_path / "archive")
        for run in plan.grid_runs(["3e-6"]):
            write_run(out, run, *grid_run(0.148, validation))
        made = study4.choices(out)
        assert made["first_choices"]["cagrpo"] == "3e-6"
        assert made["grid_lrs"] == ["1e-6", *plan.FIRST_GRID] and made["grid_final"]


TEST2 = Path(__file__).resolve().parents[1] / "docs/results/evidence4/test2.jsonl"


@pytest.fixture(scope="module")
def test2():
    return [json.loads(line) for line in TEST2.read_text().splitlines()]


def test_the_second_test_split_is_the_committed_one_and_is_drawn_like_the_training_prompts(test2):
    assert test2 == plan.test2_rows()  # fixed with the plan; rebuilding it gives the same rows
    assert len(test2) == plan.TEST2_SIZE == 1000
    questions = [row["question"] for row in test2]
    assert len(set(questions)) == len(questions)
    assert not set(questions) & plan.excluded_questions()
    strata, train = Counter(r["stratum"] for r in test2), plan.training_strata()
    for stratum, n in train.items():  # within one prompt of the training split's proportion
        assert abs(strata[stratum] - 1000 * n / sum(train.values())) <= 1
    assert strata["plain"] == 750  # round 3's test split held none
    for row in test2:
        assert row["form"] == plan.form(row["expression"])
        assert row["stratum"] == plan.coarse_form(row["form"])


def test_round3s_test_split_holds_none_of_the_plain_questions(test2):
    from cagrpo_ray.data import ReasoningGymSource

    held_out = ReasoningGymSource(
        plan.DATASET, plan.DATASET_CONFIG, seed=0, size=plan.VALIDATION_SIZE + plan.TEST1_SIZE,
        split="eval", exclude_sizes={"train": plan.TRAIN_SIZE},
    )  # fmt: skip
    forms = Counter(plan.coarse_form(plan.form(i.metadata["expression"])) for i in held_out)
    assert forms["plain"] == 0


def test_the_second_split_reads_as_prompts_the_verifier_scores(test2):
    from cagrpo_ray.data import FilePromptSource
    from cagrpo_ray.rewards.verifiers import verify_reasoning_gym_text

    items = list(FilePromptSource(str(TEST2), question_column="question").iter_from(0))
    assert [i.question for i in items] == [r["question"] for r in test2]
    for item in random.Random(0).sample(items, 50):
        entry = {"answer": item.answer, "metadata": item.metadata}
        assert verify_reasoning_gym_text(f"So it is 3.\nAnswer: {item.answer}", entry) == 1.0
        wrong = str(int(item.answer) + 1)
        assert verify_reasoning_gym_text(f"Answer: {wrong}", entry) == 0.0


def test_forms_and_strata():
    assert plan.form("( -( -8 / 2 ) )") == "( -( n op n ) )"
    assert plan.form("-5 - -4") == "n op n"
    assert [plan.coarse_form(plan.form(e)) for e in ("3 * -1", "( ( 2 + 3 ) )", "-( 1 - 2 )")] == [
        "plain", "parenthesised", "negated"]  # fmt: skip
    assert plan.quotas(Counter(a=14997, b=2847, c=2156), 1000) == {"a": 750, "b": 142, "c": 108}
    assert sum(plan.quotas(Counter(a=1, b=1, c=1), 100).values()) == 100


def t2_cdf(t: float) -> float:
    """Student's t CDF with 2 dof, by numerical integration of its density (float64)."""
    steps, low = 200_000, -2000.0
    h = (t - low) / steps
    density = [(1 + (low + i * h) ** 2 / 2) ** -1.5 / (2 * math.sqrt(2)) for i in range(steps + 1)]
    tail = 0.5 * (1 - abs(low) / math.sqrt(2 + low * low))  # mass below `low`
    return tail + h * (sum(density) - (density[0] + density[-1]) / 2)


def test_the_t_quantile_and_interval_against_independent_references():
    assert t2_cdf(plan.t_quantile_2dof(0.975)) == pytest.approx(0.975, abs=1e-6)
    assert plan.t_quantile_2dof(0.975) == pytest.approx(4.302652729749464, rel=1e-12)
    rng = random.Random(1)
    for _ in range(20):
        d = [rng.uniform(-0.1, 0.1) for _ in range(3)]
        low, high = plan.t_interval(d)
        m, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(3)
        assert t2_cdf((high - m) / se) == pytest.approx(0.975, abs=1e-6)
        assert (low + high) / 2 == pytest.approx(m)
    with pytest.raises(ValueError, match="3 seeds"):
        plan.t_interval([0.1, 0.2])


def test_supports_and_contradicts_need_the_same_evidence_mirrored():
    rng = random.Random(2)
    mirror = {"supports the paper": "contradicts the paper", "inconclusive": "inconclusive"}
    mirror.update({v: k for k, v in mirror.items()})
    for _ in range(500):
        d = [round(rng.uniform(-0.12, 0.12), 3) for _ in range(3)]
        if statistics.stdev(d) == 0:
            continue
        ours, theirs = plan.verdict(d), plan.verdict([-x for x in d])
        assert mirror[ours["label"]] == theirs["label"]
        assert ours["t95_excludes_0"] == theirs["t95_excludes_0"]
        assert ours["sign_test_p"] == theirs["sign_test_p"]
    # round 3's d: the label it had, beside an interval that includes 0 and p = 0.125
    round3 = plan.verdict([-0.072, -0.058, -0.024])
    assert round3["label"] == "contradicts the paper" and not round3["t95_excludes_0"]
    assert round3["sign_test_p"] == 0.125
    assert round3["t95"] == pytest.approx([-0.1127, 0.0100], abs=1e-4)
    # two of three seeds no longer suffice (round 3's rule needed only two for "contradicts")
    assert plan.verdict([-0.08, -0.06, 0.01])["label"] == "inconclusive"
    assert plan.verdict([0.08, 0.06, 0.01])["label"] == "supports the paper"


def sample(uid, correct, truncated=False, tokens=10, found_by="marker", stratum="plain"):
    return {"uid": uid, "correct": correct, "truncated": truncated, "response_tokens": tokens,
            "found_by": found_by, "stratum": stratum}  # fmt: skip


def test_the_sample_table_against_brute_force_pass_at_k():
    rng = random.Random(3)
    kept = [
        sample(f"p{p}", rng.random() < 0.4, truncated=rng.random() < 0.2,
               stratum="plain" if p % 3 else "negated")
        for p in range(40) for _ in range(4)
    ]  # fmt: skip
    table = plan.sample_table(kept)
    for k in range(1, 5):
        brute = statistics.fmean(
            statistics.fmean(
                any(kept[4 * p + i]["correct"] for i in subset)
                for subset in itertools.combinations(range(4), k)
            )
            for p in range(40)
        )
        assert table[f"pass@{k}"] == pytest.approx(brute)
    uncut = [s["correct"] for s in kept if not s["truncated"]]
    assert table["pass@1 uncut"] == pytest.approx(statistics.fmean(uncut))
    assert table["truncated"] == pytest.approx(statistics.fmean(s["truncated"] for s in kept))
    n, value = table["by_stratum"]["negated"]
    assert n == 4 * 14 and value == pytest.approx(
        statistics.fmean(s["correct"] for s in kept if s["stratum"] == "negated")
    )


def test_the_evaluation_keeps_one_record_per_sample_in_order():
    items = [
        SimpleNamespace(uid="u0", metadata={"stratum": "plain"}),
        SimpleNamespace(uid="u1", metadata={"expression": "-( 3 + -2 )"}),  # round 3's items
    ]
    texts = [["Answer: 3", "it is 4"], ["\\boxed{5}", "Answer: 6 and so"]]
    groups = [
        [SimpleNamespace(text=t, token_ids=[0] * (5 + j), finish_reason="length" if j else "stop")
         for j, t in enumerate(g)]
        for g in texts
    ]  # fmt: skip

    def evaluate(engine, tokenizer, items_, reward_fn, samples, sampling, instruction=None):
        out = engine.generate(["p"] * len(items_), sampling)
        scored = [i for i in items_ for _ in range(samples)]
        results = reward_fn([c.text for g in out for c in g], scored)
        return {"n": len(results)}

    def reward_fn(texts_, items_):
        return [SimpleNamespace(reward=float(t.endswith("3")), correct=t.endswith("3"))
                for t in texts_]  # fmt: skip

    engine = SimpleNamespace(generate=lambda prompts, sampling: groups)
    kept: list[dict] = []
    metrics = study4_eval.recording(evaluate, kept)(
        engine, None, items, reward_fn, 2, SimpleNamespace(max_tokens=200)
    )
    assert metrics == {"n": 4} and len(kept) == 4
    assert [(r["uid"], r["sample"]) for r in kept] == [("u0", 0), ("u0", 1), ("u1", 0), ("u1", 1)]
    assert [r["found_by"] for r in kept] == ["marker", "last_number", "boxed", "marker"]
    assert [r["answer"] for r in kept] == ["3", "4", "5", "6"]
    assert [r["truncated"] for r in kept] == [False, True, False, True]
    assert [r["correct"] for r in kept] == [True, False, False, False]
    assert kept[1]["response_tokens"] == 6
    assert [r["stratum"] for r in kept] == ["plain", "plain", "negated", "negated"]


def test_the_verdict_reads_every_seeds_samples_on_the_second_split(tmp_path):
    out = tmp_path / "out"
    (out / study4.TESTS).mkdir(parents=True)
    chosen = {"grpo": "1e-5", "cagrpo": "3e-6"}
    made = {"chosen_lr": chosen}
    rng = random.Random(4)
    import gzip

    for run in plan.verdict_runs(chosen):
        assert study4.verdict(out, made) is None  # until every verdict run has its samples
        rate = 0.3 if run.method == "grpo" else 0.2
        kept = [sample(f"p{p}", rng.random() < rate) for p in range(200) for _ in range(4)]
        path = out / study4.TESTS / f"{run.name}-test2-T0.7.samples.jsonl.gz"
        with gzip.open(path, "wt") as handle:
            handle.write("".join(json.dumps(s) + "\n" for s in kept))
    found = study4.verdict(out, made)
    assert found["split"] == "test2" and found["setting"] == "T0.7" and len(found["d"]) == 3
    assert found["label"] == "contradicts the paper"
    assert all(0 < se < 0.05 for se in found["paired_se"])


def test_round3s_statistics_on_its_page_come_from_its_kept_test_results():
    """docs/results/evidence3.md section 6, from the kept per-prompt counts alone."""
    import evidence3_stats as stats

    d, se = [], []
    for seed in (1, 2, 3):
        grpo = stats.correct_fractions(stats.load(stats.run_name("grpo", seed), "T0.7"))
        cagrpo = stats.correct_fractions(stats.load(stats.run_name("cagrpo", seed), "T0.7"))
        diffs = [cagrpo[u] - grpo[u] for u in grpo]
        d.append(statistics.fmean(diffs))
        se.append(plan.paired_se(diffs))
    assert [round(x, 3) for x in d] == [-0.072, -0.058, -0.024]
    assert [round(x, 3) for x in se] == [0.019, 0.016, 0.019]
    assert [round(x, 3) for x in plan.t_interval(d)] == [-0.112, 0.009]
    assert plan.sign_test_p(d) == 0.125


def write_samples(out: Path, name: str, split: str, setting: str, rate: float, rng) -> None:
    import gzip

    n = int(plan.TEST_SETTINGS[split][setting][1])
    kept = [sample(f"p{p}", rng.random() < rate, truncated=rng.random() < 0.1)
            for p in range(50) for _ in range(n)]  # fmt: skip
    path = out / study4.TESTS / f"{study4.result_name(name, split, setting)}.samples.jsonl.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as handle:
        handle.write("".join(json.dumps(s) + "\n" for s in kept))


def write_every_test(out: Path, name: str, rng) -> None:
    """Samples of policy `name` on every split and setting, correct at a rate of 0.1 for the
    start, 0.3 for a GRPO policy and 0.2 for a CA-GRPO one (so that the rule contradicts)."""
    rate = 0.1 if name == "start" else 0.3 if "-grpo-" in name else 0.2
    for split, settings in plan.TEST_SETTINGS.items():
        for setting in settings:
            write_samples(out, name, split, setting, rate, rng)


def test_the_progress_page_shows_each_test_as_it_comes_and_the_verdict_at_the_end(tmp_path):
    """`write_table` through the whole study: the runs, then each policy's tests as they come,
    then (every verdict policy tested on both splits) the tables and the rule's label."""
    out, page = tmp_path / "out", tmp_path / "runs.md"
    out.mkdir()
    study4.restore(out, tmp_path / "archive")
    rng = random.Random(5)
    for run in plan.grid_runs(["3e-6"]):
        write_run(out, run, *grid_run(0.148, [0.15, 0.16, 0.17]))
    study4.write_table(out, page)
    text = page.read_text()
    assert "| grid-grpo-lr3e-6-s1 | 60 |" in text and "Tests so far" not in text
    assert not (tmp_path / study4.FIGURE).exists()
    write_every_test(out, "grid-grpo-lr3e-6-s1", rng)
    study4.write_table(out, page)
    text = page.read_text()
    [row] = [line for line in text.splitlines() if line.startswith("| grid-grpo-lr3e-6-s1 | 0.")]
    assert row.count("(cut ") == 4 and "Verdict" not in text
    assert (tmp_path / study4.FIGURE).stat().st_size > 0 and f"]({study4.FIGURE})" in text

    for run in plan.grid_runs(["1e-6"]):
        write_run(out, run, *grid_run(0.148, [0.15, 0.15, 0.15]))
    made = study4.choices(out)
    for run in plan.seed_runs(made["chosen_lr"]):  # CA-GRPO's at 3e-6; GRPO's are round 3's
        if study3.finished(run, out) is None:
            write_run(out, run, *grid_run(0.148, [0.15, 0.16, 0.17]))
    made = study4.choices(out)
    assert study4.every_lr_chosen(made)
    for name in ["start"] + [r.name for r in plan.verdict_runs(made["chosen_lr"])]:
        write_every_test(out, name, rng)
    study4.write_table(out, page)
    text = page.read_text()
    assert text.count("(cut ") == 4 * (2 + len(plan.verdict_runs(made["chosen_lr"])))
    assert "## test2, T0.7" in text and "missing" not in text
    verdict_line = [line for line in text.splitlines() if line.startswith("Verdict (test2")]
    assert len(verdict_line) == 1 and '"label": "contradicts the paper"' in verdict_line[0]
    primary = json.loads(verdict_line[0].split("`")[1])
    rows = [line for line in text.splitlines() if line.startswith("| test")]
    assert [row.split(" | ")[0] for row in rows] == [
        f"| {split}, {setting}"
        for split, settings in plan.TEST_SETTINGS.items()
        for setting in settings
    ]
    [row] = [row for row in rows if row.startswith("| test2, T0.7 |")]
    cells = row.split(" | ")
    assert cells[1] == ", ".join(
        f"{d:+.3f} ({se:.3f})" for d, se in zip(primary["d"], primary["paired_se"], strict=True)
    )
    assert cells[2] == f"{primary['mean_d']:+.3f}" and cells[-1] == "contradicts the paper |"

    # The figure's points: every tested policy on every split and setting, its pass@1 the
    # share of its samples judged correct (every prompt has the same number of samples).
    points = study4.test_points(out, made, study4.sample_tables(out, made))
    assert list(points) == [(sp, st) for sp, sts in plan.TEST_SETTINGS.items() for st in sts]
    tested = [
        "start",
        "grid-grpo-lr3e-6-s1",
        *(r.name for r in plan.verdict_runs(made["chosen_lr"])),
    ]
    for (split, setting), rows in points.items():
        assert sorted(row["name"] for row in rows) == sorted(dict.fromkeys(tested))
        for row in rows:
            kept = study4.samples(out, row["name"], split, setting)
            assert row["pass@1"] == pytest.approx(sum(s["correct"] for s in kept) / len(kept))
            run = next(
                (r for r in plan.verdict_runs(made["chosen_lr"]) if r.name == row["name"]), None
            )
            if run is not None:
                assert (row["method"], row["lr"], row["seed"]) == (run.method, run.lr, run.seed)
        assert [row["method"] for row in rows if row["name"] == "start"] == ["start"]


def finished_study(tmp_path: Path) -> Path:
    """A run folder where every training run of the plan has finished (round 3's restored from
    its archive) and no policy is left: what a new machine sees before the verdict's tests."""
    out = tmp_path / "out"
    out.mkdir()
    study4.restore(out, tmp_path / "archive")
    for run in plan.grid_runs(["3e-6"]):
        write_run(out, run, *grid_run(0.148, [0.15, 0.16, 0.17]))
    for run in plan.grid_runs(["1e-6"]):
        write_run(out, run, *grid_run(0.148, [0.15, 0.15, 0.15]))
    for run in plan.seed_runs(study4.choices(out)["chosen_lr"]):
        if study3.finished(run, out) is None:
            write_run(out, run, *grid_run(0.148, [0.15, 0.16, 0.17]))
    return out


def test_main_stops_declines_or_retrains_each_verdict_policy_and_always_leaves_the_page(
    tmp_path, monkeypatch
):
    """`main`'s three ends once every run has trained: STOP starts nothing; a retrain that would
    not end by --finish-by is declined after the start's tests, which reach the page; otherwise
    each verdict policy is trained again and tested, and the page gets the verdict."""
    out = finished_study(tmp_path)
    page, archive = tmp_path / "runs.md", tmp_path / "archive"
    rng, calls = random.Random(6), []

    def fake_test(name, model, out, src, archive=None):
        if study4.tested(name, out):
            return
        calls.append(("test", name, model))
        write_every_test(out, name, rng)

    def fake_retrain(run, out, commit, src, archive=None):
        calls.append(("retrain", run.name))
        policy = out / study3.RETRAIN / run.name / "policy"
        policy.mkdir(parents=True)
        return policy

    monkeypatch.setattr(study4, "pinned_source", lambda out: ("0" * 40, tmp_path))
    monkeypatch.setattr(study4, "execute", lambda *a, **k: pytest.fail("every run has trained"))
    monkeypatch.setattr(study4, "test_policy", fake_test)
    monkeypatch.setattr(study3, "retrain", fake_retrain)
    monkeypatch.setattr(study3, "expected_s", lambda run, out: 2700.0)
    monkeypatch.setattr(study3, "seconds_until", lambda clock: 600.0)
    argv = ["--out", str(out), "--page", str(page), "--archive", str(archive)]

    (out / "STOP").touch()
    assert study4.main(argv) == 0 and calls == [] and not page.exists()
    (out / "STOP").unlink()

    assert study4.main([*argv, "--finish-by", "12:00"]) == 0
    assert calls == [("test", "start", "smollm2-135m-instruct")]
    text = page.read_text()
    [start_row] = [line for line in text.splitlines() if line.startswith("| start | 0.")]
    assert start_row.count("(cut ") == 4 and "Verdict" not in text

    calls.clear()
    assert study4.main(argv) == 0
    names = [r.name for r in plan.verdict_runs(study4.choices(out)["chosen_lr"])]
    assert len(names) == 6
    assert calls == [
        step
        for name in names
        for step in (("retrain", name), ("test", name, str(out / study3.RETRAIN / name / "policy")))
    ]
    verdict_line = [line for line in page.read_text().splitlines() if line.startswith("Verdict")]
    assert len(verdict_line) == 1 and '"label": "contradicts the paper"' in verdict_line[0]


def test_the_table_of_another_run_folder_stays_in_it(tmp_path):
    """Only the study's own run folder writes the committed page; another --out gets its own."""
    committed = study4.EVIDENCE / "runs.md"
    before = committed.read_bytes()
    out = finished_study(tmp_path)
    assert study4.main(["--out", str(out), "--archive", str(tmp_path / "kept"),
                        "--aggregate-only"]) == 0  # fmt: skip
    assert "| grid-cagrpo-lr1e-6-s1 | 60 |" in (out / "runs.md").read_text()
    assert committed.read_bytes() == before
