"""The driver: what runs a training run on a Ray cluster.

- `loop.py`: `TrainingLoop`, the one Ray loop that feeds the schedule (`cagrpo_ray.schedule`,
  a plain state machine): generation, scoring, training and weight sync, overlapped as far as
  the staleness bound allows; its per-step counters (`Counters`) and their metrics.
- `roles.py`: `build_roles`, which starts the run's actors in order (verifiers, the plan's
  check, the reservation, generator replicas, learner ranks) into a `Roles` that closes them.
- `trainer.py`: `Trainer`, which has the roles built, runs the loop, evaluates, checkpoints
  and reports.

The Python API (`cagrpo_ray.api`) and the command (`cagrpo_ray.run`) are the entry points.
This package imports nothing, so that importing one module does not start the others.
"""
