"""The second evidence round's rules (experiments/study2_plan.py): each method's learning rate
from its training accuracy, the late-phase verdict on a GRPO run, and the regime chosen."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from study2_plan import (  # noqa: E402
    CANDIDATES,
    LRS,
    best_lr,
    collapse_verdict,
    late_regime,
    stages,
    sweep_runs,
)

pytestmark = pytest.mark.unit


def test_best_lr_reads_the_last_ten_steps_of_training_accuracy_only():
    records = {}
    for run in sweep_runs():
        lr = float(run.overrides["algorithm.lr"])
        late = {"grpo": 0.5 + (lr == 1e-4) * 0.1, "cagrpo": 0.4 + (lr == 4e-4) * 0.1}[run.method]
        early = [{"accuracy/train": 0.99, "eval/pass@1": 0.9}] * 50  # ignored: not the last 10
        records[run.name] = early + [{"accuracy/train": late, "eval/pass@1": 0.0}] * 10
    assert best_lr(records) == {"grpo": "1e-4", "cagrpo": "4e-4"}
    flat = {name: [{"accuracy/train": 0.5}] * 10 for name in records}
    assert best_lr(flat) == {"grpo": "1e-4", "cagrpo": "1e-4"}  # ties: the smaller lr


def run_records(entropies):
    return [{"step": i + 1, "entropy/mean": h} for i, h in enumerate(entropies)]


def test_collapse_verdict_needs_both_the_collapse_and_the_late_fall():
    collapsing = run_records([0.1] * 10 + [0.08] * 100 + [0.04] * 10)
    steady = run_records([0.1] * 120)
    fall = {0: {"T0.7/pass@1": 0.3}, 60: {"T0.7/pass@1": 0.5}, 120: {"T0.7/pass@1": 0.45}}
    flat = {0: {"T0.7/pass@1": 0.3}, 60: {"T0.7/pass@1": 0.5}, 120: {"T0.7/pass@1": 0.49}}
    v = collapse_verdict(collapsing, fall)
    assert v["entropy_ratio"] == pytest.approx(0.4) and v["late_phase"]
    assert not collapse_verdict(collapsing, flat)["late_phase"]  # fell by less than 0.03
    assert not collapse_verdict(steady, fall)["late_phase"]


def test_late_regime_prefers_the_first_with_a_late_phase_else_the_steepest_fall():
    verdicts = {
        "A": {"late_phase": False, "entropy_ratio": 0.6},
        "B": {"late_phase": True, "entropy_ratio": 0.45},
        "C": {"late_phase": True, "entropy_ratio": 0.2},
    }
    assert late_regime(verdicts)[0] == "B"
    for v in verdicts.values():
        v["late_phase"] = False
    key, why = late_regime(verdicts)
    assert key == "C" and "no candidate" in why
    verdicts["C"]["broke"] = True  # the steepest fall, but its accuracy is gone: not a regime
    assert late_regime(verdicts)[0] == "B"
    for v in verdicts.values():
        v["broke"] = True
    assert late_regime(verdicts) == (None, "no candidate showed a late phase and every one broke")


def test_a_run_broke_when_its_final_accuracy_is_below_its_start():
    records = run_records([0.1] * 30)
    held = {0: {"T0.7/pass@1": 0.40}, 10: {"T0.7/pass@1": 0.42}, 30: {"T0.7/pass@1": 0.36}}
    v = collapse_verdict(records, held)
    assert v["start_T0.7"] == 0.40 and v["broke"] and v["fell"] and not v["late_phase"]
    held[30] = {"T0.7/pass@1": 0.38}  # 0.02 below the start: within LATE_FALL
    assert not collapse_verdict(records, held)["broke"]


def test_stages_wait_for_the_choices_they_depend_on():
    assert [len(s) for s in stages(None, None)] == [2 * len(LRS), len(CANDIDATES)]
    names = [r.name for s in stages({"grpo": "1e-4", "cagrpo": "4e-4"}, "B") for r in s]
    assert len(names) == len(set(names))
    assert "lateB-grpo-s1" not in names  # the search run search-grpo-B-s1 is that run
    assert {"best-cagrpo-lr4e-4-s2", "lateB-kl_cov-s3", "lateB-cagrpo_ctl-s3"} <= set(names)


def fake_run(out, run, acc, entropy, final, steps):
    """A finished run's folder: metrics, summary (evals at T=1, 0.7, greedy, harder split)
    and provenance, with the numbers the page's tables read."""
    import json

    d = out / run.name
    d.mkdir(parents=True)
    records = [
        {"step": s, "accuracy/train": acc, "entropy/mean": entropy(s), "policy/kl_step": 1e-4,
         "learner/grad_norm": 0.5, "learner/tokens": 2000.0, "policy/clip_frac": 0.01,
         "kl_cov/selected_frac": 2e-3, "kl_cov/abs_log_ratio": 0.01, "cagrpo/kappa": 1.0}
        for s in range(1, steps + 1)
    ]  # fmt: skip
    ev = {f"{split}{t}pass@1": final for split in ("", "hard/") for t in ("", "T0.7/", "T0/")}
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    summary = {"eval_before": {k: 0.3 for k in ev}, "eval_after": ev, "final_step": steps}
    (d / "summary.json").write_text(json.dumps(summary))
    prov = {"started_utc": "2026-11-30T10:00:00Z", "finished_utc": "2026-11-30T10:05:00Z",
            "wall_s": 300, "returncode": 0, "machine": {"nproc": "2", "os": "FakeOS"}}  # fmt: skip
    (d / "provenance.json").write_text(json.dumps(prov))


def test_page_is_computed_from_the_runs_and_the_rules(tmp_path):
    import json

    import study2
    from study2_page import render_page

    for run in sweep_runs():
        lr = float(run.overrides["algorithm.lr"])
        acc = 0.6 if (run.method, lr) in (("grpo", 2e-4), ("cagrpo", 4e-4)) else 0.5
        fake_run(tmp_path, run, acc, lambda s: 0.1, 0.4 if run.method == "grpo" else 0.25, 60)
    for run in stages(None, None)[1]:  # the search: only B collapses
        collapse = run.name == "search-grpo-B-s1"
        fake_run(tmp_path, run, 0.7, lambda s, c=collapse: 0.1 * (0.3 if c and s > 100 else 1.0),
                 0.4, 150)  # fmt: skip
    made = study2.choices(tmp_path)
    assert made["best_lr"] == {"grpo": "2e-4", "cagrpo": "4e-4"}
    # B collapses but its held-out accuracy holds: no late phase, B has the steepest fall
    assert made["late"] == "B" and "no candidate" in made["late_why"]
    (tmp_path / "choices.json").write_text(json.dumps(made))
    page = render_page(study2.planned(tmp_path), tmp_path, tmp_path / "page" / "e.md", "cmd")
    assert "| GRPO | 2e-4 (chosen) | 0.600 |" in page
    assert "| CA-GRPO | 4e-4 (chosen) | 0.600 |" in page
    assert "Chosen: regime B" in page
    assert (
        f"Finished runs: {2 * len(LRS) + len(CANDIDATES)} of " in page
        and "not run (why: the status below): " in page
    )
    assert (tmp_path / "page" / "evidence2" / "lr_sweep.png").exists()


def test_run_option_selects_planned_runs_in_the_order_given(tmp_path, capsys):
    import study2

    names = ["search-grpo-B-s1", "sweep-grpo-lr1e-4-s1"]
    assert (
        study2.main(["--out", str(tmp_path), "--dry-run", "--run", names[0], "--run", names[1]])
        == 0
    )
    printed = capsys.readouterr().out.splitlines()
    assert [next(a for a in line.split() if a.startswith("run.name=")) for line in printed] == [
        f"run.name={n}" for n in names
    ]
    with pytest.raises(SystemExit) as exit_:  # the late stage is not planned before the search
        study2.main(["--out", str(tmp_path), "--dry-run", "--run", "lateB-cagrpo-s1"])
    assert exit_.value.code == 2
    assert "not in the plan (so far): lateB-cagrpo-s1" in capsys.readouterr().err
