"""Entry point: `python -m cagrpo_ray.run --config configs/cpu-tiny.yaml [--resume auto]`
(`cagrpo_ray/api.py` has the same run as `train()`, for a script or a notebook).

Joins the Ray cluster named by `RAY_ADDRESS` (as inside `ray job submit`) or starts a local
one, then trains as the config says. `--resume auto` (or `--resume` alone) continues from the
latest checkpoint of the run directory that verifies, and starts at step 0 when there is none,
so the same command serves a first attempt and every retry.

The command runs the driver in a session of its own under a small outer process
(`cagrpo_ray/supervisor.py`): Ctrl-C or SIGTERM, to this process or to its whole process
group, finishes the current step, writes a checkpoint, stops the run's actors and the local
Ray cluster, and nothing the run started is left running. Exit status: 0 when the run
finished; 128 + the signal's number when a signal stopped it (143 SIGTERM, 130 Ctrl-C), its
checkpoint written, so that no scheduler takes it for a finished run (`--resume auto`
continues it); 2 for bad input; 1 for any other error, among them a learner rank lost once
more than `run.max_restarts` allows (each loss before that is recovered inside the run).

The console shows the project's lines and ends with the final table; what Ray, vLLM and
DeepSpeed print is in `runs/<name>/logs/` (`cagrpo_ray/console.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

# The outer process imports only this: it starts the driver and waits, and torch, Ray and the
# config (what the driver imports in `main`) would cost it ~2 s of CPU before the driver starts.
from cagrpo_ray.supervisor import DRIVER_ENV, supervise


def main(argv: list[str] | None = None) -> int:
    from cagrpo_ray import api
    from cagrpo_ray.config import ConfigError, add_config_args, load_config, to_yaml

    parser = argparse.ArgumentParser(prog="python -m cagrpo_ray.run", description=__doc__)
    add_config_args(parser)
    parser.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        choices=["auto"],
        help="auto (the same as --resume alone): continue from the latest checkpoint of the "
        "run directory that verifies, or start at step 0 when it has none.",
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
    run_dir = Path(config.run.output_dir) / config.run.name
    try:
        summary = api.run_training(config, resume=args.resume == "auto")
    except Exception as exc:
        error = exc
    else:
        error = None
    from cagrpo_ray.errors import StoppedWithCheckpoint, UserError

    if isinstance(error, UserError):
        # bad input found once the run looks at it: one line, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(error, StoppedWithCheckpoint):  # the checkpoint is intact
        print(f"error: {error}", file=sys.stderr)
        return 1
    if error is not None:
        traceback.print_exception(error)
        print(where_the_output_is(error, run_dir), file=sys.stderr)
        return 1
    print(api.final_report(summary), flush=True)  # the last thing printed
    stop_signal = summary.get("stop_signal")
    return 128 + stop_signal if stop_signal else 0  # the shell's status for a signal's end


def where_the_output_is(error: BaseException, run_dir: Path) -> str:
    """The log file of the actor the error came from, or else the folder of all of them."""
    from cagrpo_ray.console import log_dir, logs_for_error

    logs = log_dir(run_dir)
    files = logs_for_error(error, logs)
    if files:
        return "the failed actor's output: " + ", ".join(map(str, files))
    return f"every actor's output, and the driver's: {logs}/"


if __name__ == "__main__":
    raise SystemExit(main() if os.environ.get(DRIVER_ENV) else supervise(sys.argv[1:]))
