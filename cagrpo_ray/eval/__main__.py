"""`python -m cagrpo_ray.eval --model <dir> --data <source> --samples <k>`; see `cli.py`."""

from cagrpo_ray.eval.cli import main

if __name__ == "__main__":  # vLLM starts its engine core in a subprocess that imports this
    main()
