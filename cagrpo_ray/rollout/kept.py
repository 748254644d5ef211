"""Generator replicas kept up from one run to the next.

Starting a replica (its actor, vLLM's engine core, the model, the warm-up) is most of a short
run's start. A `KeptGenerators` given to several `Trainer`s in turn, on one Ray cluster, lets
them share one set of replicas: the first run starts them in placement groups of their own and
leaves them up when it ends; each later run whose config starts its replicas the same way
(`replica_key`: engine, policy, engine options, environment, bundle) uses them as they are,
and one whose config differs ends them and starts its own, which it keeps in turn. The owner
ends the last set with `close()`.

Nothing a run learns stays in a kept replica: each run forms its own weight-sync group with
them and loads its learner's weights before its first request (`TrainingLoop.start`), which also
resets the prefix cache, and every request carries its own seed (`schedule.step_seed`), so a
run's samples are those it would draw from replicas of its own. The replicas keep writing to
the log folder of the run that started them.
"""

from __future__ import annotations

import logging

import ray
from ray.util.placement_group import remove_placement_group

log = logging.getLogger("cagrpo_ray")


def replica_key(config, model_path: str, cpu_env: list[dict]) -> str:
    """What a run's replicas are started with, in one string: two runs whose keys are equal
    can share replicas. `cpu_env` is each replica's CPU environment (`cpu_engine_env`)."""
    from cagrpo_ray.env.episode import environment_options
    from cagrpo_ray.placement import generator_bundle
    from cagrpo_ray.rollout.engines import engine_options

    r = config.rollout
    replicas = [
        (generator_bundle(config, i), engine_options(config, i), cpu_env[i])
        for i in range(r.num_generators)
    ]
    return repr((r.engine, str(model_path), environment_options(config), replicas))


class KeptGenerators:
    """Generator replicas that outlive the run that started them (see the module docstring)."""

    def __init__(self):
        self.actors: list = []
        self.key: str | None = None
        self._groups: list = []

    def fits(self, key: str) -> bool:
        """Replicas are up and were started as `key` says."""
        return bool(self.actors) and self.key == key

    def hold(self, actors: list, groups: list, key: str) -> None:
        """Keep `actors`, started as `key` says in the placement groups `groups`."""
        self.close()
        self.actors, self._groups, self.key = list(actors), list(groups), key

    def close(self) -> None:
        """End the replicas and free their placement groups."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for group in self._groups:
            try:
                remove_placement_group(group)
            except Exception:  # already gone with its cluster
                log.debug("placement group already removed", exc_info=True)
        self.actors, self._groups, self.key = [], [], None
