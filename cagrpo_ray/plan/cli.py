"""Does a recipe fit its cluster? The planner's command line:

    python -m cagrpo_ray.plan --config configs/gpu-r1-distill-1.5b.yaml --nodes 1 [--json]

The cluster's shape comes from the config's `cluster` section; `--nodes`, `--gpus-per-node`
and `--gpu-memory-gib` override it. Prints which actor goes on which GPU and each GPU's memory
by component (`--json`: the same as one object). Exit status: 0 fits, 1 does not fit (the
message names the component and the GPU), 2 the config, the model's shape or the cluster's
shape is wrong or missing. Works offline.
"""

from __future__ import annotations

import argparse
import json
import sys

from cagrpo_ray.config import ConfigError, add_config_args, load_config

CLUSTER_FLAGS = (  # (flag, config key)
    ("nodes", "cluster.nodes"),
    ("gpus_per_node", "cluster.gpus_per_node"),
    ("gpu_memory_gib", "cluster.gpu_memory_gib"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cagrpo_ray.plan", description=__doc__.split("\n\n")[0]
    )
    add_config_args(parser)
    parser.add_argument("--nodes", type=int, help="GPU nodes (cluster.nodes).")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node (cluster.gpus_per_node).")
    parser.add_argument(
        "--gpu-memory-gib", type=float, help="Memory of one GPU in GiB (cluster.gpu_memory_gib)."
    )
    parser.add_argument("--json", action="store_true", help="Print the plan as one JSON object.")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    overrides += [
        f"{key}={getattr(args, flag)}"
        for flag, key in CLUSTER_FLAGS
        if getattr(args, flag) is not None
    ]
    try:
        config = load_config(args.config, overrides)
    except (ConfigError, OSError) as exc:
        print(exc, file=sys.stderr)
        return 2

    from cagrpo_ray.plan import ModelShapeError, PlanError, plan, render, to_json

    try:
        result = plan(config)
    except (ModelShapeError, PlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(result), indent=2) if args.json else render(result))
    return 0 if result.fits else 1
