"""DeepSpeed policy learners: one data-parallel rank (`Learner`) and m of them on Ray
(`LearnerGroup`)."""

from cagrpo_ray.learner.group import LearnerGroup, LearnerGroupError, split_by_groups
from cagrpo_ray.learner.learner import BATCH_KEYS, Learner

__all__ = ["BATCH_KEYS", "Learner", "LearnerGroup", "LearnerGroupError", "split_by_groups"]
