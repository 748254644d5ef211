"""Verifiable rewards: verifiers, their process pool with hard timeouts, and the code sandbox."""

from cagrpo_ray.rewards.custom import RewardFunctionError, load_reward_functions
from cagrpo_ray.rewards.extract import (
    extract_boxed,
    extract_code,
    extract_final_answer,
    extract_tagged,
)
from cagrpo_ray.rewards.function import RewardError, RewardFunction, RewardResult
from cagrpo_ray.rewards.pool import VerifierPool
from cagrpo_ray.rewards.sandbox import SandboxLimits, SandboxRun, run_solution
from cagrpo_ray.rewards.verifiers import TASK_VERIFIERS, builtin_verifiers

__all__ = [
    "TASK_VERIFIERS",
    "RewardError",
    "RewardFunction",
    "RewardFunctionError",
    "RewardResult",
    "SandboxLimits",
    "SandboxRun",
    "VerifierPool",
    "builtin_verifiers",
    "extract_boxed",
    "extract_code",
    "extract_final_answer",
    "extract_tagged",
    "load_reward_functions",
    "run_solution",
]
