"""Two learner ranks on one batch: the groups split by count against split by tokens.

    flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_learner_split.py \
        [--config configs/cpu-tiny.yaml] [--steps 8] [--out FILE]

The learner group hands each rank whole prompt groups. Cut by count, a rank whose groups
happen to hold the longer responses trains for longer, and the other waits for it at every
collective (the gradient reduction of each micro-batch under ZeRO-2, the batch statistics):
sampled once a second during a SmolLM2-135M-Instruct run (`configs/cpu-smollm2.yaml`), one
rank's CPU stood at ~0 for 5-6 s at a time while the other's was at 100%, several times in a
45 s learner phase. `learner.shard_by: tokens` (the default) balances the ranks' tokens
(`split_by_groups` in `learner/group.py`); `count` is the split by count.

Here: the config's `LearnerGroup` (its ranks, ZeRO stage, micro-batch, loss; the policy it
names) on a local Ray cluster of the machine's cores, trained on batches shaped like the
config's (`rollout.prompts_per_step` groups of `rollout.group_size` responses), whose response
lengths are drawn per group (a group's prompts make its responses long or short together:
a group mean uniform over `--response A:B`, each response within +-25% of it, at most
`rollout.max_tokens`), prompts uniform
over `--prompt A:B`. The two splits alternate step by step on the same batches, one untimed
step of each first; each row: the median seconds of `--steps` steps and the mean over steps of
the larger rank's share of the tokens (0.5 is even).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from cagrpo_ray.metrics.provenance import report  # noqa: E402


def make_batch(groups, size, prompt, response, longest, vocab, rng, shared=False):
    """A learner batch of random tokens; with `shared`, a group's rows share one prompt (as
    rollouts do: one prompt, `size` responses)."""
    from cagrpo_ray.algo.advantages import group_advantages

    means = rng.uniform(*response, groups)
    lengths = np.clip(
        np.round(np.repeat(means, size) * rng.uniform(0.75, 1.25, groups * size)), 1, longest
    ).astype(int)
    prompts = rng.integers(*prompt, groups * size)
    first = np.arange(groups).repeat(size) * size  # each row's group's first row
    if shared:
        prompts = prompts[first]
    width = int((prompts + lengths).max())
    columns = np.arange(width)
    attention = torch.as_tensor(columns < (prompts + lengths)[:, None]).long()
    response_mask = torch.as_tensor(columns >= prompts[:, None]) & attention.bool()
    rewards = torch.as_tensor(rng.integers(0, 2, groups * size)).float()
    ids = torch.as_tensor(rng.integers(3, vocab, (groups * size, width)))
    if shared:
        ids = torch.where(response_mask, ids, ids[first])
    return {
        "input_ids": ids * attention,
        "attention_mask": attention,
        "response_mask": response_mask,
        "behavior_logprobs": -torch.rand(groups * size, width) * response_mask,
        "rewards": rewards,
        "advantages": group_advantages(rewards, size),
        "group_ids": torch.arange(groups).repeat_interleave(size),
        "policy_version": torch.zeros(groups * size, dtype=torch.long),
    }


def larger_share(shards) -> float:
    tokens = [int(s["attention_mask"].sum()) for s in shards]
    return max(tokens) / sum(tokens)


def span(text: str) -> tuple[int, int]:
    a, b = text.split(":")
    return int(a), int(b)


def arguments(doc: str, prompt: tuple[int, int], response: tuple[int, int]):
    """The options of a learner benchmark on batches shaped like a config's."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default="configs/cpu-tiny.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt", type=span, default=prompt, help="prompt tokens A:B")
    parser.add_argument("--response", type=span, default=response, help="response tokens A:B")
    parser.add_argument("--set", action="append", default=[], help="a config override")
    parser.add_argument("--out", type=Path, default=None, help="append the result to this file")
    return parser.parse_args()


def shaped_batches(args, shared: bool = False):
    """(config, policy path, `args.steps` + 1 batches shaped like the config's)."""
    from transformers import AutoConfig

    from cagrpo_ray.config import load_config
    from cagrpo_ray.policies.build import resolve_policy

    config = load_config(args.config, args.set)
    path = str(resolve_policy(config.model.path))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    rng = np.random.default_rng(0)
    r = config.rollout
    batches = [
        make_batch(
            r.prompts_per_step, r.group_size, args.prompt, args.response, r.max_tokens, vocab, rng,
            shared,
        )
        for _ in range(args.steps + 1)
    ]  # fmt: skip
    return config, path, batches


def command(script: str, args) -> str:
    """The command line that reruns a learner benchmark with `args`."""
    return (
        f"flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/{script} "
        f"--config {args.config} --steps {args.steps}"
        + "".join(f" --set {s}" for s in args.set)
        + f" --prompt {args.prompt[0]}:{args.prompt[1]}"
        + f" --response {args.response[0]}:{args.response[1]}"
    )


def main() -> None:
    args = arguments(__doc__, prompt=(18, 26), response=(10, 45))

    import ray

    from cagrpo_ray.learner import group as group_module
    from cagrpo_ray.learner.settings import learner_settings, loss_spec

    config, path, batches = shaped_batches(args)
    r = config.rollout
    splits = {"by count": "count", "by tokens": "tokens"}
    ray.init(num_cpus=config.learner.num_learners, include_dashboard=False)
    seconds: dict[str, list[float]] = {name: [] for name in splits}
    shares: dict[str, list[float]] = {name: [] for name in splits}
    try:
        learners = group_module.LearnerGroup(
            config.learner.num_learners,
            learner_settings(config, path),
            loss_spec(config),
            num_cpus_per_learner=1,
        )
        for index, batch in enumerate(batches):
            for name, split in splits.items():
                learners.shard_by = split
                start = time.perf_counter()
                learners.train_step(batch)
                if index:  # the first step of each is a warm-up
                    seconds[name].append(time.perf_counter() - start)
                    shares[name].append(
                        larger_share(
                            group_module.split_by_groups(batch, learners.num_learners, split)
                        )
                    )
        learners.shutdown()
    finally:
        ray.shutdown()
    base = statistics.median(seconds["by count"])
    rows = [
        [name, f"{statistics.median(s):.3f}", f"{base / statistics.median(s):.2f}",
         f"{statistics.mean(shares[name]):.3f}"]
        for name, s in seconds.items()
    ]  # fmt: skip
    report(
        "Two learner ranks: groups split by count or by tokens",
        ["split", "median s/step", "speed vs by count", "larger rank's token share"],
        rows,
        out=args.out,
        notes=[
            f"{args.config} ({config.model.path}, {config.learner.num_learners} ranks, ZeRO "
            f"{config.learner.zero_stage}, micro-batch {config.learner.micro_batch_size}); "
            f"{r.prompts_per_step} groups x {r.group_size} a step, prompts {args.prompt}, "
            f"group mean response {args.response} tokens; {args.steps} timed steps each."
        ],
        command=command("bench_learner_split.py", args),
    )  # fmt: skip


if __name__ == "__main__":
    main()
