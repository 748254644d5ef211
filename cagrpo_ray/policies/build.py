"""Build, cache and load policies: small warm-started local ones, or any Hugging Face causal LM.

    python -m cagrpo_ray.policies.build --task chain_sum --out runs/policy

builds (or reuses from the cache) the policy of the named preset: a small random-init Qwen2
model, warm-started by supervised fine-tuning on R1-format worked solutions of the task's
procedural data, then measured on held-out prompts. A build is cached under
`$XDG_CACHE_HOME/cagrpo_ray/policies/<task>-<hash of the spec>` (default `~/.cache`) and reused
by every later `ensure_policy` of the same spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.data.solutions import worked_solution
from cagrpo_ray.policies.accuracy import accuracy
from cagrpo_ray.policies.model import PolicySize, new_policy, parameter_count, save_policy
from cagrpo_ray.policies.sft import encode_examples, train_sft

log = logging.getLogger(__name__)

# Bump when a code change alters what a spec builds, so that stale cached builds are not reused.
BUILD_VERSION = 1
BUILD_INFO = "build_info.json"


@dataclass(frozen=True)
class PolicySpec:
    """Everything that determines a built policy; its hash is the cache key."""

    task: str = "chain_sum"  # reasoning_gym dataset with a worked-solution writer
    task_config: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1}
    )  # the dataset's config fields
    size: PolicySize = field(default_factory=PolicySize)
    sft_steps: int = 400  # optimizer steps of the warm start; each sees new examples
    batch_size: int = 64  # examples per step
    lr: float = 1.5e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine decay to a tenth of `lr`
    weight_decay: float = 0.01
    seed: int = 0  # initial weights and the task's seed regions (see ReasoningGymSource)
    eval_size: int = 256  # held-out prompts for the accuracy in build_info.json
    max_new_tokens: int = 64  # response budget when measuring accuracy

    @property
    def sft_size(self) -> int:
        """Examples the warm start draws from the task's "sft" split; an eval split that must
        hold no question the policy was trained on excludes this many (`exclude_sizes`)."""
        return self.sft_steps * self.batch_size

    def key(self) -> str:
        """Cache key: the task name and a hash of the spec and `BUILD_VERSION`."""
        canonical = json.dumps({"build_version": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return f"{self.task}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"

    def with_budget(self, sft_steps: int) -> PolicySpec:
        """The same spec with a different number of warm-start steps (warm-up scaled along)."""
        warmup = max(1, round(self.warmup_steps * sft_steps / self.sft_steps))
        return dataclasses.replace(self, sft_steps=sft_steps, warmup_steps=warmup)


PRESETS: dict[str, PolicySpec] = {
    "chain_sum": PolicySpec(),
    # More terms and digits: longer chains, more places to go wrong, more room for RL.
    "chain_sum_hard": PolicySpec(
        task_config={"min_terms": 3, "max_terms": 5, "min_digits": 2, "max_digits": 3},
        max_new_tokens=96,
    ),
}


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/cagrpo_ray/policies`, with `~/.cache` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cagrpo_ray" / "policies"


def build_policy(
    spec: PolicySpec, out_dir: str | Path, *, progress: bool = True, threads: int | None = None
) -> Path:
    """Build the policy of `spec` into `out_dir` and return it.

    Writes the model and tokenizer in the Hugging Face layout and `build_info.json` with the
    parameter count, build seconds, held-out accuracy sampled at temperature 1 and greedy, and
    the spec. Deterministic for a spec on one machine and thread count (`threads`, default
    the torch default capped at 2).
    """
    start = time.monotonic()
    torch.set_num_threads(threads or min(2, torch.get_num_threads()))
    say = _stage_printer(progress)
    n_examples = spec.sft_size
    say(f"drawing {n_examples} {spec.task} examples and {spec.eval_size} held-out prompts")
    sft_items = list(ReasoningGymSource(spec.task, spec.task_config, spec.seed, n_examples, "sft"))
    held_out = list(
        ReasoningGymSource(
            spec.task,
            spec.task_config,
            spec.seed,
            spec.eval_size,
            "eval",
            exclude_sizes={"sft": n_examples},
        )
    )
    model, tokenizer = new_policy(spec.seed, spec.size)
    examples = encode_examples(tokenizer, sft_items, [worked_solution(i) for i in sft_items])
    n_parameters = parameter_count(model)
    say(f"warm start: {spec.sft_steps} steps of {spec.batch_size}, {n_parameters:,} parameters")
    losses = train_sft(
        model,
        examples,
        steps=spec.sft_steps,
        batch_size=spec.batch_size,
        lr=spec.lr,
        warmup_steps=spec.warmup_steps,
        weight_decay=spec.weight_decay,
        pad_token_id=tokenizer.pad_token_id,
        progress=progress,
    )
    train_seconds = time.monotonic() - start
    say("measuring held-out accuracy")
    sampled, sampled_responses, lengths = accuracy(
        model, tokenizer, held_out, sample=True, max_new_tokens=spec.max_new_tokens, seed=spec.seed
    )
    greedy, _, _ = accuracy(
        model, tokenizer, held_out, sample=False, max_new_tokens=spec.max_new_tokens
    )
    out = save_policy(model, tokenizer, out_dir)
    info = {
        "key": spec.key(),
        "parameters": parameter_count(model),
        "build_seconds": round(time.monotonic() - start, 1),
        "train_seconds": round(train_seconds, 1),
        "threads": torch.get_num_threads(),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "heldout_accuracy_sampled": sampled,
        "heldout_accuracy_greedy": greedy,
        "heldout_size": len(held_out),
        "mean_sampled_response_tokens": sum(lengths) / len(lengths),
        "example_responses": [
            {"question": item.question, "answer": item.answer, "response": response}
            for item, response in zip(held_out[:4], sampled_responses[:4], strict=True)
        ],
        "spec": asdict(spec),
    }
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    say(
        f"built {out}: held-out accuracy {sampled:.1%} sampled, {greedy:.1%} greedy, "
        f"{info['build_seconds']:.0f} s"
    )
    return out


def ensure_policy(spec: PolicySpec, *, progress: bool = True, threads: int | None = None) -> Path:
    """The cached build of `spec`, building it first when the cache does not hold it.

    Concurrent callers wait on a lock file and build once; a build lands in the cache by an
    atomic rename, so an interrupted build never leaves a half-written policy behind.
    """
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    path = root / spec.key()
    with open(root / f"{spec.key()}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / BUILD_INFO).is_file():
            return path
        staging = root / f".{spec.key()}.building-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        build_policy(spec, staging, progress=progress, threads=threads)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(staging, path)
    return path


def resolve_policy(name_or_dir: str | Path) -> str:
    """A path or hub name that `from_pretrained` and vLLM load.

    An existing directory is returned as is; a preset name (see `PRESETS`) is built or taken
    from the cache; anything else is taken as a Hugging Face hub name, e.g.
    "Qwen/Qwen2.5-Math-1.5B".
    """
    if Path(name_or_dir).is_dir():
        return str(name_or_dir)
    if str(name_or_dir) in PRESETS:
        return str(ensure_policy(PRESETS[str(name_or_dir)]))
    return str(name_or_dir)


def load_policy(name_or_dir: str | Path, dtype: torch.dtype | None = None, **model_kwargs):
    """(model, tokenizer) of any Hugging Face causal LM: a directory, a preset or a hub name.

    `dtype` defaults to the checkpoint's own; `model_kwargs` go to `from_pretrained`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_policy(name_or_dir)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto", **model_kwargs)
    return model, tokenizer


def _stage_printer(enabled: bool):
    def say(message: str) -> None:
        if enabled:
            print(f"[policy build] {message}", file=sys.stderr, flush=True)

    return say


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="chain_sum", choices=sorted(PRESETS))
    parser.add_argument("--out", help="copy the built policy here (default: print its cache path)")
    parser.add_argument("--steps", type=int, help="warm-start steps instead of the preset's")
    parser.add_argument("--seed", type=int, help="seed instead of the preset's")
    parser.add_argument("--threads", type=int, help="torch threads (default: up to 2)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    spec = PRESETS[args.task]
    if args.steps is not None:
        spec = spec.with_budget(args.steps)
    if args.seed is not None:
        spec = dataclasses.replace(spec, seed=args.seed)
    path = ensure_policy(spec, progress=not args.quiet, threads=args.threads)
    if args.out:
        shutil.copytree(path, args.out, dirs_exist_ok=True)
        path = Path(args.out)
    info = json.loads((path / BUILD_INFO).read_text())
    print(
        json.dumps(
            {
                "path": str(path),
                **{k: info[k] for k in ("parameters", "build_seconds", "heldout_size")},
                "heldout_accuracy_sampled": info["heldout_accuracy_sampled"],
                "heldout_accuracy_greedy": info["heldout_accuracy_greedy"],
            }
        )
    )


if __name__ == "__main__":
    main()
