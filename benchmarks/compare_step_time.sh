#!/usr/bin/env bash
# The CPU default's step time and per-step metrics at two commits, side by side, alternating
# (old, new, old, new) so that the machine's drift hits both alike:
#   benchmarks/compare_step_time.sh <old-commit> [steps]
# Each run is configs/cpu-tiny.yaml (bound 0) with a 16-prompt held-out set; the mean
# `time/step` leaves out the first 4 steps. Run it on an otherwise idle machine.
set -euo pipefail
OLD=${1:?an old commit to compare with}
STEPS=${2:-14}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git -C "$ROOT" archive "$OLD" | tar -x -C "$WORK" --one-top-level=old
for round in 1 2; do
  for tree in old new; do
    src=$([ $tree = old ] && echo "$WORK/old" || echo "$ROOT")
    (cd "$src" && PYTHONPATH=$src $PY -m cagrpo_ray.run --config configs/cpu-tiny.yaml \
      --set run.steps="$STEPS" --set run.name=$tree-$round --set run.output_dir="$WORK/runs" \
      --set data.eval_size=16 --set metrics.enabled=false --set metrics.inspect_every=0 \
      > "$WORK/$tree-$round.log" 2>&1)
  done
done
$PY - "$WORK/runs" <<'PYEOF'
import json, sys
runs = sys.argv[1]
def load(name):
    return [json.loads(line) for line in open(f"{runs}/{name}/metrics.jsonl")]
timed = ("time/", "throughput/", "sync/", "generators/idle_fraction", "learner/time/", "data/cursor")
print("| run | mean time/step (s, after 4) |")
print("|---|---|")
for r in (1, 2):
    for tree in ("old", "new"):
        t = [x["time/step"] for x in load(f"{tree}-{r}")[4:]]
        print(f"| {tree} {r} | {sum(t) / len(t):.3f} |")
old, new = load("old-1"), load("new-1")
pairs = [(k, a[k], b.get(k)) for a, b in zip(old, new) for k in a if not k.startswith(timed)]
print(f"per-step metrics, old vs new: {sum(x == y for _, x, y in pairs)} equal, "
      f"{sum(x != y for _, x, y in pairs)} different")
PYEOF
