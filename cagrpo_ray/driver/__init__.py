"""The driver: what runs a training run on a Ray cluster.

- `loop.py`: `TrainingLoop`, the one Ray loop that feeds the schedule (`cagrpo_ray.schedule`,
  a plain state machine): generation, scoring, training and weight sync, overlapped as far as
  the staleness bound allows; its per-step counters (`Counters`) and their metrics.
- `trainer.py`: `Trainer`, which builds the roles (generators, verifiers, learners), runs the
  loop, evaluates, checkpoints and reports.

The Python API (`cagrpo_ray.api`) and the command (`cagrpo_ray.run`) are the entry points.
This package imports nothing, so that importing one module does not start the others.
"""
