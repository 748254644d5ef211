"""Entry point: `python -m cagrpo_ray.run --config configs/cpu-tiny.yaml [--resume]`.

Joins the Ray cluster named by `RAY_ADDRESS` (as inside `ray job submit`) or starts a local
one, then trains as the config says. Ctrl-C or SIGTERM finishes the current step, writes a
checkpoint and exits cleanly; `--resume` continues from the latest checkpoint of the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

from cagrpo_ray.config import ConfigError, add_config_args, load_config, to_yaml


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
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    import ray

    from cagrpo_ray.trainer import make_trainer, required_cpus

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # Logical CPUs only schedule actors; a 2-core machine hosts the whole pipeline.
        num_cpus = config.run.ray_num_cpus or max(
            os.cpu_count() or 1, math.ceil(required_cpus(config))
        )
        ray.init(num_cpus=num_cpus, include_dashboard=False)
    summary = make_trainer(config, resume=args.resume).run()
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
