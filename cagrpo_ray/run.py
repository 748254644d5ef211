"""Entry point: `python -m cagrpo_ray.run --config configs/cpu-tiny.yaml [--resume]`.

Joins the Ray cluster named by `RAY_ADDRESS` (as inside `ray job submit`) or starts a local
one, then trains as the config says. Ctrl-C or SIGTERM finishes the current step, writes a
checkpoint and exits cleanly; `--resume` continues from the latest checkpoint of the run.
The console shows the project's lines and ends with the final table; what Ray, vLLM and
DeepSpeed print is in `runs/<name>/logs/` (`cagrpo_ray/console.py`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from pathlib import Path

from cagrpo_ray.config import ConfigError, add_config_args, load_config, to_yaml

PROCESS_GROUP_CLEANUP = "RAY_process_group_cleanup_enabled"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cagrpo_ray.run", description=__doc__)
    add_config_args(parser)
    parser.add_argument(
        "--resume", action="store_true", help="Continue from the latest checkpoint."
    )
    parser.add_argument("--print-config", action="store_true", help="Print the resolved config.")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(config), end="")
        return 0
    from cagrpo_ray.console import configure_driver_logging

    run_dir = Path(config.run.output_dir) / config.run.name
    configure_driver_logging(run_dir)  # the libraries' log records and warnings: to a file
    import ray

    from cagrpo_ray.data.files import PromptFileError
    from cagrpo_ray.placement import PlacementError
    from cagrpo_ray.plan import PlanError
    from cagrpo_ray.policies.build import PolicyPathError
    from cagrpo_ray.schedule import DynamicSamplingError
    from cagrpo_ray.trainer import Trainer, required_cpus

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # Each Ray worker in a process group of its own, ended by the raylet when the worker
        # exits: a replica that dies takes its vLLM engine's processes with it
        # (tests/test_replica_exit.py). A cluster started elsewhere sets it itself (k8s/).
        os.environ.setdefault(PROCESS_GROUP_CLEANUP, "1")
        # Logical CPUs only schedule actors; a 2-core machine hosts the whole pipeline.
        num_cpus = config.run.ray_num_cpus or max(
            os.cpu_count() or 1, math.ceil(required_cpus(config))
        )
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    try:
        summary = Trainer(config, resume=args.resume).run()
    except Exception as exc:
        error = exc
    else:
        error = None
    finally:
        # The actors are gone; what Ray would still forward from them is in their log files,
        # and nothing prints after what comes next.
        ray.shutdown()
    if isinstance(error, PromptFileError | PolicyPathError | PlacementError | PlanError):
        # bad input found once the run looks at it: one line, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(error, DynamicSamplingError):  # the latest checkpoint stays as it was
        print(f"error: {error}", file=sys.stderr)
        return 1
    if error is not None:
        traceback.print_exception(error)
        print(where_the_output_is(error, run_dir), file=sys.stderr)
        return 1
    print(final_report(summary), flush=True)  # the last thing printed
    return 0


def where_the_output_is(error: BaseException, run_dir: Path) -> str:
    """The log file of the actor the error came from, or else the folder of all of them."""
    from cagrpo_ray.console import log_dir, logs_for_error

    logs = log_dir(run_dir)
    files = logs_for_error(error, logs)
    if files:
        return "the failed actor's output: " + ", ".join(map(str, files))
    return f"every actor's output, and the driver's: {logs}/"


REPORT_ROWS = (  # (label, key in the eval results, format)
    ("pass@1", "pass@1", "{:.3f}"),
    ("pass@k", None, "{:.3f}"),  # the largest k evaluated
    ("maj@k", None, "{:.3f}"),
    ("mean response tokens", "mean_response_tokens", "{:.1f}"),
    ("responses calling a tool", "tool_call_fraction", "{:.3f}"),
    ("sampled-token entropy (nats)", "mean_sampled_token_nll", "{:.3f}"),
)


def final_report(summary: dict) -> str:
    """A short before/after table of the held-out evaluation and where the outputs are."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    k = (after or before).get("samples", 1)
    lines = [f"{'held-out':<30}{'before':>10}{'after':>10}"]
    for label, key, fmt in REPORT_ROWS:
        if key is None:
            key = f"{label[:-1]}{k}"
            if key == "pass@1":
                continue  # one sample: the first row already says it
            label = key
        if key == "tool_call_fraction" and key not in before and key not in after:
            continue  # a single-turn run
        cells = [fmt.format(e[key]) if key in e else "-" for e in (before, after)]
        lines.append(f"{label:<30}{cells[0]:>10}{cells[1]:>10}")
    step_s = (summary.get("time/step") or {}).get("mean")
    if step_s is not None:
        lines.append(f"{'seconds per step (mean)':<30}{'':>10}{step_s:>10.2f}")
    run_dir = summary.get("run_dir", "")
    lines += [
        "",
        f"steps trained: {summary.get('final_step')}"
        + (f" (stopped by signal at {summary['stopped_at']})" if "stopped_at" in summary else ""),
        f"metrics:  {run_dir}/metrics.jsonl",
        f"plots:    {run_dir}/plots/",
        f"summary:  {run_dir}/summary.json",
    ]
    if summary.get("inspect_dir"):
        lines.append(f"tokens:   python -m cagrpo_ray.inspect {run_dir} --serve 8000")
    if summary.get("policy_dir"):
        lines.append(
            f"policy:   {summary['policy_dir']}  "
            f"(python -m cagrpo_ray.eval --model {summary['policy_dir']} ...)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
