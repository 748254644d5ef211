"""The evidence study's finished runs as read from disk, and the statistics over their seeds.

A run's folder `<out>/<run>/` holds `metrics.jsonl` (one record per learner step),
`summary.json` (held-out evals before and after training) and `provenance.json` (how, where and
from which commit it ran). The tables and the figures read runs only through `Loaded`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from study_plan import Run

EARLY = 10  # steps 1..EARLY form the "early" window, the last EARLY steps the "late" one


def finite(v) -> bool:
    """Whether `v` is a finite number (metrics log NaN and inf as null)."""
    return isinstance(v, int | float) and math.isfinite(float(v))


@dataclass
class Loaded:
    """One finished run as read from disk."""

    run: Run
    records: list[dict]
    summary: dict
    provenance: dict  # empty when the run recorded none

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one per-step metric, over the steps where it is finite."""
        pts = [(r["step"], float(r[key])) for r in self.records if finite(r.get(key))]
        return [p[0] for p in pts], [p[1] for p in pts]

    def window(self, key: str, which: str) -> float:
        """Mean of `key` over the early (first EARLY) or late (last EARLY) steps."""
        _, values = self.series(key)
        if not values:
            return math.nan
        part = values[:EARLY] if which == "early" else values[-EARLY:]
        return sum(part) / len(part)

    def heldout(self) -> dict[int, dict]:
        """Held-out eval results by step: 0 (before), every eval_every step, and the final."""
        out = {0: self.summary["eval_before"]} if "eval_before" in self.summary else {}
        for r in self.records:
            if finite(r.get("eval/pass@1")):
                out[r["step"]] = {
                    k[len("eval/") :]: v for k, v in r.items() if k.startswith("eval/")
                }
        if "eval_after" in self.summary:
            out[self.summary["final_step"]] = self.summary["eval_after"]
        return out

    def at(self, step: int, metric: str) -> float:
        """A held-out metric at one checkpoint (NaN when the run was not evaluated there)."""
        return self.heldout().get(step, {}).get(metric, math.nan)


def load(runs: list[Run], out: Path) -> dict[str, Loaded]:
    """The runs whose summary exists, by name (unfinished ones are reported as missing)."""
    loaded = {}
    for run in runs:
        d = out / run.name
        if not (d / "summary.json").exists():
            continue
        records = [
            json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
        summary = json.loads((d / "summary.json").read_text())
        prov = d / "provenance.json"
        provenance = json.loads(prov.read_text()) if prov.exists() else {}
        loaded[run.name] = Loaded(run, records, summary, provenance)
    return loaded


def by_method(loaded: dict[str, Loaded], group: str) -> dict[str, list[Loaded]]:
    """The runs of one study group (probe, main, ...) by method, each list sorted by seed."""
    out: dict[str, list[Loaded]] = {}
    for item in loaded.values():
        if item.run.group == group:
            out.setdefault(item.run.method, []).append(item)
    for items in out.values():
        items.sort(key=lambda x: x.run.seed)
    return out


def checkpoints(items: list[Loaded]) -> list[int]:
    """Every step at which any of the runs was evaluated on the held-out set, in order."""
    return sorted({s for it in items for s in it.heldout()})


def mean_std(values: list[float]) -> tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; std is NaN for n < 2, mean for n = 0."""
    values = [v for v in values if finite(v)]
    if not values:
        return math.nan, math.nan, 0
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return statistics.fmean(values), sd, len(values)


def fmt(values: list[float], digits: int = 3) -> str:
    """ "mean ± std" over seeds, "mean (n=1)" for one seed, "–" for none."""
    m, s, n = mean_std(values)
    if n == 0:
        return "–"
    if n == 1:
        return f"{m:.{digits}f} (n=1)"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def eval_se(p: float, num_prompts: int, samples: int) -> float:
    """Binomial standard error of a pass@1 estimate from num_prompts x samples draws, a lower
    bound of the true one (samples of one prompt are correlated)."""
    return math.sqrt(max(p * (1 - p), 1e-12) / (num_prompts * samples))
