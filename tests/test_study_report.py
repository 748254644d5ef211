"""The evidence study's page rendered from fake finished runs; the benchmarks' results writer."""

import json
import re
import sys
from pathlib import Path

import pytest

from cagrpo_ray.metrics.provenance import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from study_page import render_page, source_commit  # noqa: E402
from study_plan import plan  # noqa: E402
from study_results import load  # noqa: E402

pytestmark = pytest.mark.unit

STUDY_COMMIT = "1234567890abcdef1234567890abcdef12345678"
PROBE_COMMIT = "fedcba0987654321fedcba0987654321fedcba09"
MACHINE = {"nproc": "3", "cpu": "Fake CPU", "ram_gib": "7.5", "os": "FakeOS", "python": "3.11.0"}
STEPS = 12
# final held-out pass@1 by run: two seeds of GRPO and CA-GRPO in the main grid, and a few more
FINAL_PASS1 = {
    "main-grpo-s1": 0.411,
    "main-grpo-s2": 0.433,
    "main-cagrpo-s1": 0.150,
    "main-cagrpo-s2": 0.170,
    "main-kl_cov-s1": 0.411,  # trains exactly like GRPO of its seed
    "abl-cagrpo_batch-s1": 0.200,
    "probe-grpo-s0": 0.300,
    "ones-grpo-s0": 0.280,
    "ones-cagrpo_ones-s0": 0.280,
}


def record(step: int, method: str, seed: int) -> dict:
    """One learner step's metrics with every key the page's tables read."""
    r = {
        "step": step,
        "entropy/mean": 0.1 + 0.01 * step + 0.001 * seed,
        "accuracy/train": 0.5 + 0.01 * step,
        "response/length_mean": 20.0 + step,
        "learner/grad_norm": 0.5,
        "reward/equal_reward_groups": 0.25,
        "reward/mean": 0.4,
        "loss/total": -0.01 * step,
        "policy/ratio_max": 1.0,
        "policy/ratio_mean": 1.0,
        "policy/clip_frac": 0.0,
        "policy/approx_kl": 0.0,
        "learner/tokens": 2400,
        "time/step": 1.0 + 0.1 * seed,  # differs between the identical runs: must be ignored
    }
    for f in ("0.01pct", "1pct", "20pct", "40pct"):
        r[f"cov/pos_{f}"], r[f"cov/neg_{f}"] = 0.5, -0.5
    if method.startswith("cagrpo"):
        r |= {"cagrpo/weight_p01": 0.02, "cagrpo/weight_max": 3.0, "cagrpo/weight_mean": 1.0}
    if step == STEPS // 2:
        r |= {"eval/pass@1": 0.3, "eval/pass@4": 0.6}
    return r


def write_fake_study(out: Path) -> None:
    """Finished runs for a few names of the plan, with the files the runner and training write."""
    runs = {r.name: r for r in plan()}
    for name, final in FINAL_PASS1.items():
        run, d = runs[name], out / name
        d.mkdir(parents=True)
        lines = [json.dumps(record(s, run.method, run.seed)) for s in range(1, STEPS + 1)]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        summary = {
            "eval_before": {"pass@1": 0.25, "pass@4": 0.5, "num_prompts": 200, "samples": 4},
            "eval_after": {"pass@1": final, "pass@4": final + 0.2},
            "final_step": STEPS,
        }
        (d / "summary.json").write_text(json.dumps(summary))
        provenance = {
            "command": f"python -m cagrpo_ray.run --set run.name={name}",
            "source_commit": PROBE_COMMIT if run.group == "probe" else STUDY_COMMIT,
            "started_utc": "2026-01-01T00:00:00Z",
            "finished_utc": "2026-01-01T01:00:00Z",
            "wall_s": 60.0,
            "returncode": 0,
        }
        if run.group != "probe":  # the hand-started probe recorded no machine
            provenance["machine"] = MACHINE
        (d / "provenance.json").write_text(json.dumps(provenance))
    (out / "SOURCE_COMMIT").write_text(STUDY_COMMIT + "\n")
    gradient = {
        "norm": 0.1234,
        "cosine_to_grpo": 0.5,
        "entropy_change_after_one_adam_step": 0.00042,
        "loglik_correct_change": -0.0123,
        "loglik_incorrect_change": 0.0456,
    }
    tokens = {
        "tokens": 17,
        "share_of_tokens": 0.007,
        "mean_logp": -2.5,
        "mean_abs_advantage": 1.1,
        "share_in_correct_responses": 0.25,
        "share_with_positive_advantage": 0.5,
    }
    anatomy = {
        "config": {"prompts": 16, "group_size": 8, "seeds": [0], "lr": 2e-5},
        "batches": [
            {
                "seed": 0,
                "batch": {
                    "responses": 128,
                    "tokens": 2400,
                    "accuracy": 0.5,
                    "equal_reward_groups": 0.25,
                    "entropy": 0.1,
                },
                "tokens": {"c > 0": tokens, "c < 0": {"tokens": 0}},
                "gradients": {"grpo": gradient},
            }
        ],
    }
    (out / "anatomy.json").write_text(json.dumps(anatomy))


def render(tmp_path: Path) -> str:
    out, page = tmp_path / "study", tmp_path / "docs" / "evidence.md"
    text, missing = render_page(plan(), out, page, invocation="study.py --aggregate-only")
    assert set(missing) == {r.name for r in plan()} - set(FINAL_PASS1)
    assert (page.parent / "evidence" / "heldout.png").exists()
    assert (page.parent / "evidence" / "kernel_weights.png").exists()
    return text


def test_page_holds_the_runs_numbers_and_their_recorded_commits(tmp_path):
    write_fake_study(tmp_path / "study")
    text = render(tmp_path)

    assert not re.search(r"\{[a-z_0-9]+(:[^}]*)?\}", text), "a placeholder was left unfilled"
    # held-out pass@1 at the last step, mean ± std over the two seeds, and paired differences
    assert re.search(
        r"\| grpo \(n=2\) \| 0\.250 ± 0\.000 \| 0\.300 ± 0\.000 \| 0\.422 ± 0\.016 \|", text
    )
    assert "| cagrpo (n=2) | 0.250 ± 0.000 | 0.300 ± 0.000 | 0.160 ± 0.014 |" in text
    assert "s1: -0.261, s2: -0.263" in text
    assert "| main-cagrpo-s1 | early | nan | 0.02 | 1 | 3 | nan | nan | nan |" in text
    assert "| grpo | early | +0.5 | +0.5 | +0.5 | +0.5 | -0.5 | -0.5 | -0.5 | -0.5 |" in text
    assert "**GRPO vs CA-GRPO with `cagrpo_kernel=ones`**: bit-for-bit identical" in text
    assert "**GRPO vs KL-Cov, main grid seed 1**: bit-for-bit identical" in text
    assert "| cagrpo_batch (n=1) | 0.250 (n=1) | 0.300 (n=1) | 0.200 (n=1) |" in text
    assert "| 0 | grpo | 0.1234 | 0.500 | +0.00042 | -0.0123 | +0.0456 |" in text
    # the commits and the machine are the recorded ones, not this checkout's or this machine's
    assert f"commit `{STUDY_COMMIT}`" in text
    assert f"probe-grpo-s0 at commit {PROBE_COMMIT[:7]}" in text
    assert (
        f"| main-grpo-s1 | main | 2026-01-01T00:00:00Z | 60.0 | 0 | {STUDY_COMMIT[:10]} |" in text
    )
    assert "3 cores (Fake CPU), python 3.11.0, 7.5 GiB, FakeOS" in text


def test_study_commit_falls_back_to_the_runs_records_without_the_pin(tmp_path):
    out = tmp_path / "study"
    write_fake_study(out)
    (out / "SOURCE_COMMIT").unlink()
    assert source_commit(out, load(plan(), out)) == STUDY_COMMIT  # the probe's commit left out


def test_report_prints_the_rows_and_appends_a_markdown_section(tmp_path, capsys):
    out = tmp_path / "results" / "bench.md"
    out.parent.mkdir()
    out.write_text("# Bench\n")
    for title in ("First", "Second"):
        report(
            title,
            ["size", "ms"],
            [["tiny", 1.5], ["large", "12.25"]],
            out=out,
            notes=["Best of 3."],
            command="python bench.py --repeats 3",
        )
    printed = capsys.readouterr().out
    assert "size   ms\n-----  -----\ntiny   1.5\nlarge  12.25" in printed
    assert "Best of 3." in printed
    text = out.read_text()
    assert text.startswith("# Bench\n\n## First\n\n")
    assert (
        text.count("| size | ms |\n|---|---|\n| tiny | 1.5 |\n| large | 12.25 |\n\nBest of 3.") == 2
    )
    assert "Command: `python bench.py --repeats 3`" in text
    assert re.search(r"## Second\n\n\d{4}-\d\d-\d\d, \d+ cores \(.*\), python .*; commit \S+", text)
