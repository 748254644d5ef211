"""The learner step with each group's prompt run once (shared) against once per response.

    flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_shared_prompts.py \
        [--config configs/cpu-tiny.yaml] [--steps 8] [--prompt A:B] [--response A:B] [--out FILE]

A rollout group is one prompt and `rollout.group_size` responses, and the learner batch holds
one row per response, so the prompt is in every row. `learner.share_prompts` (the default)
runs it once per micro-batch with the group's responses packed after it, where the decoder's
estimated cost says that is cheaper (`cagrpo_ray/learner/packing.py`); off, every row is run
whole. Here: two `LearnerGroup`s of the config, one with it on and one with it off, on a local
Ray cluster of the machine's cores, trained in turn on the same batches shaped like the
config's (`bench_learner_split.make_batch` with shared prompts: a group's prompt uniform over
`--prompt A:B` tokens, its responses around a group mean uniform over `--response A:B`), one
untimed step each first. Each row: the median seconds of `--steps` steps, the speed against
"off", and the largest difference of the step's loss from "off"'s (the two groups see the same
batches from the same weights: only rounding should differ).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_learner_split import arguments, command, shaped_batches  # noqa: E402

from cagrpo_ray.metrics.provenance import report  # noqa: E402


def main() -> None:
    args = arguments(__doc__, prompt=(70, 79), response=(10, 30))

    import ray

    from cagrpo_ray.learner import group as group_module
    from cagrpo_ray.learner.settings import learner_settings, loss_spec

    config, path, batches = shaped_batches(args, shared=True)
    r = config.rollout
    variants = {"off (a row per response)": False, "shared prompts": True}
    settings = learner_settings(config, path)
    # a core per rank of each group (the groups take turns: one group's ranks idle at a time)
    ray.init(num_cpus=len(variants) * config.learner.num_learners, include_dashboard=False)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    try:
        groups = {
            name: group_module.LearnerGroup(
                config.learner.num_learners,
                dataclasses.replace(settings, share_prompts=share),
                loss_spec(config),
                num_cpus_per_learner=1,
            )
            for name, share in variants.items()
        }
        for index, batch in enumerate(batches):
            for name, learners in groups.items():
                start = time.perf_counter()
                metrics = learners.train_step(batch)
                if index:  # the first step of each is a warm-up
                    seconds[name].append(time.perf_counter() - start)
                losses[name].append(metrics["loss/total"])
        for learners in groups.values():
            learners.shutdown()
    finally:
        ray.shutdown()
    base_name = next(iter(variants))
    base = statistics.median(seconds[base_name])
    rows = [
        [name, f"{statistics.median(s):.3f}", f"{base / statistics.median(s):.2f}",
         f"{max(abs(a - b) for a, b in zip(losses[name], losses[base_name], strict=True)):.1e}"]
        for name, s in seconds.items()
    ]  # fmt: skip
    tokens = [int(b["attention_mask"].sum()) for b in batches]
    report(
        "The learner step: each group's prompt once (shared) or once per response",
        ["variant", "median s/step", "speed vs off", "max |loss - off's|"],
        rows,
        out=args.out,
        notes=[
            f"{args.config} ({config.model.path}, {config.learner.num_learners} ranks, ZeRO "
            f"{config.learner.zero_stage}, micro-batch {config.learner.micro_batch_size}); "
            f"{r.prompts_per_step} groups x {r.group_size} a step, a group's prompt "
            f"{args.prompt} tokens, group mean response {args.response} tokens (~"
            f"{statistics.mean(tokens):.0f} tokens a step in the row layout); {args.steps} "
            "timed steps each."
        ],
        command=command("bench_shared_prompts.py", args),
    )  # fmt: skip


if __name__ == "__main__":
    main()
