"""`python -m cagrpo_ray.inspect RUN_DIR [--step N] [--out FILE] [--serve PORT]`; see `cli.py`."""

from cagrpo_ray.inspect.cli import main

main()
