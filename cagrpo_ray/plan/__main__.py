"""`python -m cagrpo_ray.plan --config FILE [--nodes N] [--json]`; see `cli.py`."""

from cagrpo_ray.plan.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
