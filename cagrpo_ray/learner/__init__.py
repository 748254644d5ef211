"""DeepSpeed policy learners: one data-parallel rank (`Learner`) and m of them on Ray
(`LearnerGroup`)."""

from cagrpo_ray.learner.batch import BATCH_KEYS
from cagrpo_ray.learner.group import LearnerGroup, LearnerGroupError, split_by_groups
from cagrpo_ray.learner.learner import Learner
from cagrpo_ray.learner.settings import LearnerSettings

__all__ = [
    "BATCH_KEYS",
    "Learner",
    "LearnerGroup",
    "LearnerGroupError",
    "LearnerSettings",
    "split_by_groups",
]
