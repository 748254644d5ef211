"""Build, cache and load policies: small warm-started local ones, or any Hugging Face causal LM.

    python -m cagrpo_ray.policies.build --task chain_sum --out runs/policy

builds (or reuses from the cache) the policy of the named preset: a small random-init Qwen2
model, warm-started by supervised fine-tuning on R1-format worked solutions of the task's
procedural data, then measured on held-out prompts. A build is cached under
`$XDG_CACHE_HOME/cagrpo_ray/policies/<task>-<hash of the spec>` (default `~/.cache`) and reused
by every later `ensure_policy` of the same spec.

The default preset's build ships with the package (`policies/shipped/<key>/`, 7 MB: its 229 s
of one core is what a newcomer's first `make train` waited for, and every machine starts from
the same weights): `ensure_policy` takes it as it is while the spec's key is the shipped one's.
A change to the recipe changes the key, and the preset is built again until it is re-shipped:

    python -m cagrpo_ray.policies.build --task chain_sum --ship

`tests/test_shipped_policy.py` checks that the shipped build is the current key's and that a
rebuild reproduces its weights bit for bit on a CPU of the capability it was built on.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import random
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.data.solutions import worked_solution
from cagrpo_ray.data.types import PromptItem
from cagrpo_ray.policies.accuracy import accuracy
from cagrpo_ray.policies.cache import BUILD_INFO, PolicyPathError, cached_build
from cagrpo_ray.policies.model import PolicySize, new_policy, parameter_count, save_policy
from cagrpo_ray.policies.sft import encode_examples, train_sft

# Bump when a code change alters what a spec builds, so that stale cached builds are not reused.
BUILD_VERSION = 1


@dataclass(frozen=True)
class PolicySpec:
    """Everything that determines a built policy; its hash is the cache key."""

    task: str = "chain_sum"  # reasoning_gym dataset with a worked-solution writer
    task_config: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1}
    )  # the dataset's config fields
    size: PolicySize = field(default_factory=PolicySize)
    sft_steps: int = 800  # most optimizer steps of the warm start; each step sees new examples
    target_accuracy: float | None = 0.3  # stop once validation accuracy (sampled) reaches it;
    # None trains all `sft_steps`
    eval_every: int = 25  # steps between validation measurements
    validation_size: int = 128  # prompts for the stopping rule, apart from the reported ones
    batch_size: int = 64  # examples per step
    lr: float = 1.5e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # linear warm-up, then cosine decay to a tenth of `lr` at sft_steps
    weight_decay: float = 0.01
    seed: int = 0  # initial weights and the task's seed regions (see ReasoningGymSource)
    eval_size: int = 256  # held-out prompts for the accuracy reported in build_info.json
    max_new_tokens: int = 64  # response budget when measuring accuracy
    # Share of warm-start examples solved by a calculator call (`worked_solution(tool=True)`):
    # a policy that sometimes calls the tool, for multi-turn runs (`rollout.max_turns`).
    tool_fraction: float = 0.0

    @property
    def sft_size(self) -> int:
        """Examples the warm start may draw from the task's "sft" split; an eval split that must
        hold no question the policy was trained on excludes this many (`exclude_sizes`)."""
        return self.sft_steps * self.batch_size

    def key(self) -> str:
        """Cache key: the task name and a hash of the spec and `BUILD_VERSION`."""
        fields = asdict(self)
        if not self.tool_fraction:  # added later: the keys of the builds without tools stay
            del fields["tool_fraction"]
        canonical = json.dumps({"build_version": BUILD_VERSION, **fields}, sort_keys=True)
        return f"{self.task}-{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"

    def with_budget(self, sft_steps: int) -> PolicySpec:
        """The same spec trained for exactly `sft_steps` steps (no early stop, warm-up scaled)."""
        warmup = max(1, round(self.warmup_steps * sft_steps / self.sft_steps))
        return dataclasses.replace(
            self, sft_steps=sft_steps, warmup_steps=warmup, target_accuracy=None
        )


PRESETS: dict[str, PolicySpec] = {
    # Sums of 2 to 4 one-digit terms: 1 to 3 partial sums, responses of about 25 tokens.
    "chain_sum": PolicySpec(),
    # 3 to 5 terms of one or two digits: 2 to 4 partial sums, responses of about 45 tokens,
    # more places to go wrong, more room for RL.
    "chain_sum_hard": PolicySpec(
        task_config={"min_terms": 3, "max_terms": 5, "min_digits": 1, "max_digits": 2},
        target_accuracy=0.2,
        max_new_tokens=96,
    ),
    # Sums of 3 or 4 terms of two or three digits, where adding digit by digit often goes
    # wrong and a calculator call is the reliable path; half the warm start's examples call
    # it (`<tool>calculator: ...</tool>`), half add step by step. Its accuracy in
    # build_info.json is measured without tools (the policy writes its own `<result>`);
    # `configs/cpu-tools.yaml` trains it with the calculator.
    "chain_sum_tools": PolicySpec(
        task_config={"min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 3},
        target_accuracy=0.3,
        max_new_tokens=96,
        tool_fraction=0.5,
    ),
}


def heldout_items(spec: PolicySpec) -> tuple[list[PromptItem], list[PromptItem]]:
    """(validation prompts for the stopping rule, held-out prompts for the reported accuracy).

    Both come from the task's eval split, hold no question of the warm-start data and none
    twice, and are disjoint, so the reported accuracy is not biased by the choice of when to
    stop.
    """
    source = ReasoningGymSource(
        spec.task,
        spec.task_config,
        spec.seed,
        spec.validation_size + spec.eval_size,
        "eval",
        exclude_sizes={"sft": spec.sft_size},
    )
    items = list(source)
    return items[: spec.validation_size], items[spec.validation_size :]


def build_policy(
    spec: PolicySpec, out_dir: str | Path, *, progress: bool = True, threads: int | None = None
) -> Path:
    """Build the policy of `spec` into `out_dir` and return it.

    Writes the model and tokenizer in the Hugging Face layout and `build_info.json` with the
    parameter count, build seconds, held-out accuracy sampled at temperature 1 and greedy, and
    the spec. Deterministic for a spec on one machine and thread count (`threads`, default 1:
    on a shared 2-core machine a 2-thread build ran about 5 times slower than a 1-thread one, as
    its threads waited on each other; on an idle machine 2 threads are faster).
    """
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    try:
        return _build(spec, Path(out_dir), progress)
    finally:
        torch.set_num_threads(caller_threads)


def _build(spec: PolicySpec, out_dir: Path, progress: bool) -> Path:
    start = time.monotonic()
    say = _stage_printer(progress)
    say(f"drawing {spec.sft_size} {spec.task} examples and the held-out prompts")
    sft_items = list(
        ReasoningGymSource(spec.task, spec.task_config, spec.seed, spec.sft_size, "sft")
    )
    validation, held_out = heldout_items(spec)
    model, tokenizer = new_policy(spec.seed, spec.size)
    calls = random.Random(spec.seed).choices([True, False], k=len(sft_items), weights=(
        spec.tool_fraction, 1 - spec.tool_fraction))  # fmt: skip
    targets = [worked_solution(i, tool=c) for i, c in zip(sft_items, calls, strict=True)]
    examples = encode_examples(tokenizer, sft_items, targets)
    n_parameters = parameter_count(model)
    say(f"warm start: {n_parameters:,} parameters, at most {spec.sft_steps} steps")

    validation_history: list[dict[str, float]] = []

    def reached_target(step: int) -> bool:
        if spec.target_accuracy is None or (step + 1) % spec.eval_every:
            return False
        sampled, _, _ = accuracy(
            model,
            tokenizer,
            validation,
            sample=True,
            max_new_tokens=spec.max_new_tokens,
            seed=spec.seed,
        )
        model.train()
        validation_history.append({"step": step + 1, "accuracy_sampled": sampled})
        return sampled >= spec.target_accuracy

    train_start = time.monotonic()
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
        should_stop=reached_target,
    )
    train_seconds = time.monotonic() - train_start
    say(f"measuring held-out accuracy after {len(losses)} steps")
    sampled, sampled_responses, lengths = accuracy(
        model, tokenizer, held_out, sample=True, max_new_tokens=spec.max_new_tokens, seed=spec.seed
    )
    greedy, _, _ = accuracy(
        model, tokenizer, held_out, sample=False, max_new_tokens=spec.max_new_tokens
    )
    out = save_policy(model, tokenizer, out_dir)
    info = {
        "key": spec.key(),
        "parameters": n_parameters,
        "build_seconds": round(time.monotonic() - start, 1),
        "warm_start_seconds": round(train_seconds, 1),
        "threads": torch.get_num_threads(),
        "sft_steps_run": len(losses),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "heldout_accuracy_sampled": sampled,
        "heldout_accuracy_greedy": greedy,
        "heldout_size": len(held_out),
        "mean_sampled_response_tokens": sum(lengths) / len(lengths),
        "validation_history": validation_history,
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


SHIPPED = Path(__file__).parent / "shipped"  # builds that ship with the package, by key
SHIPPED_INFO = "shipped.json"  # the machine that built a shipped policy, and its weights' sha256


def shipped_policy(spec: PolicySpec) -> Path | None:
    """The shipped build of `spec` (module docstring), or None."""
    path = SHIPPED / spec.key()
    return path if (path / BUILD_INFO).is_file() else None


def ship_policy(spec: PolicySpec, built: Path) -> Path:
    """Copy the build of `spec` at `built` into the package's shipped builds, with the machine
    that built it (its CPU capability decides which machines can rebuild it bit for bit)."""
    out = SHIPPED / spec.key()
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(built, out)
    weights = (out / "model.safetensors").read_bytes()
    facts = {
        "key": spec.key(),
        "model_sha256": hashlib.sha256(weights).hexdigest(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": json.loads((out / BUILD_INFO).read_text()).get("threads"),
    }
    (out / SHIPPED_INFO).write_text(json.dumps(facts, indent=2) + "\n")
    return out


def ensure_policy(spec: PolicySpec, *, progress: bool = True, threads: int | None = None) -> Path:
    """The shipped build of `spec` if there is one, else its cached build, building it first
    when the cache does not hold it.

    Concurrent callers wait on a lock file and build once; a build lands in the cache by an
    atomic rename, so an interrupted build never leaves a half-written policy behind.
    """
    shipped = shipped_policy(spec)
    if shipped is not None:
        return shipped
    return cached_build(
        spec.key(), lambda staging: build_policy(spec, staging, progress=progress, threads=threads)
    )


def resolve_policy(
    name_or_dir: str | Path,
    download_dir: str | Path | None = None,
    gguf_file: str | None = None,
) -> str:
    """A path or hub name that `from_pretrained` and vLLM load.

    An existing directory is returned as is, or with `gguf_file` (a GGUF file in it), that
    file converted once into a cached HF directory; a path to a `.gguf` file likewise; a
    preset name (see `PRESETS`, and the pretrained `GGUF_PRESETS` of `policies/gguf.py`) is
    built or taken from the cache; anything else is taken as a Hugging Face hub name, e.g.
    "Qwen/Qwen2.5-Math-1.5B". With `download_dir`, a hub model is fetched into it once, here,
    and its local folder is returned: the run's actors then load from that folder (a volume
    every node mounts) instead of each downloading the same weights into one shared cache.
    """
    from cagrpo_ray.policies.gguf import GGUF_PRESETS, ensure_gguf_policy, ensure_packaged_policy

    if gguf_file is not None:
        return str(ensure_gguf_policy(Path(name_or_dir) / gguf_file))
    if Path(name_or_dir).is_dir():
        return str(name_or_dir)
    if str(name_or_dir).endswith(".gguf"):  # a GGUF file, never a hub id
        return str(ensure_gguf_policy(name_or_dir))
    if str(name_or_dir) in PRESETS:
        return str(ensure_policy(PRESETS[str(name_or_dir)]))
    if str(name_or_dir) in GGUF_PRESETS:
        return str(ensure_packaged_policy(str(name_or_dir)))
    check_hub_id(str(name_or_dir))
    if download_dir is not None:
        return fetch_hub_model(str(name_or_dir), download_dir)
    return str(name_or_dir)


# What a model directory needs to be loaded by transformers and vLLM (no other formats).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def fetch_hub_model(repo_id: str, download_dir: str | Path) -> str:
    """Download `repo_id` into `download_dir/<org>--<name>` (at most once at a time, even from
    several processes: a file lock) and return that folder."""
    from huggingface_hub import snapshot_download

    target = Path(download_dir) / repo_id.replace("/", "--")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(snapshot_download(repo_id, local_dir=target, allow_patterns=HUB_FILES))


def check_hub_id(name: str) -> None:
    """Raise `PolicyPathError` unless `name` has the form of a hub id ("org/name" or "name").

    A path that looks like a file system path (absolute, ./, ../, ~, or more than one "/")
    but is not a folder here is a typo or a missing mount, not something to download.
    """
    looks_like_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
    valid = bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)) and ".." not in name
    if looks_like_path or not valid:
        from cagrpo_ray.policies.gguf import GGUF_PRESETS

        presets = ", ".join([*PRESETS, *GGUF_PRESETS])
        raise PolicyPathError(
            f"model path {name!r} is not a folder here, nor a built-in preset ({presets}), nor "
            "a Hugging Face hub id such as 'Qwen/Qwen2.5-Math-1.5B'"
        )


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
    parser = argparse.ArgumentParser(
        prog="python -m cagrpo_ray.policies.build", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--task", default="chain_sum", choices=sorted(PRESETS))
    parser.add_argument("--out", help="copy the built policy here (default: print its cache path)")
    parser.add_argument(
        "--steps",
        type=int,
        help="train exactly this many warm-start steps, without the early stop (a small budget)",
    )
    parser.add_argument("--seed", type=int, help="seed instead of the preset's")
    parser.add_argument("--threads", type=int, help="torch threads (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--ship",
        action="store_true",
        help="build the preset (never taking a shipped build) and ship it with the package",
    )
    args = parser.parse_args(argv)
    spec = PRESETS[args.task]
    if args.steps is not None:
        spec = spec.with_budget(args.steps)
    if args.seed is not None:
        spec = dataclasses.replace(spec, seed=args.seed)
    if args.ship:
        threads = args.threads
        built = cached_build(spec.key(), lambda staging: build_policy(
            spec, staging, progress=not args.quiet, threads=threads))  # fmt: skip
        path = ship_policy(spec, built)
    else:
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
