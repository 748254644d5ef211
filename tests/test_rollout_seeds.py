"""Per-prompt seeds of a vLLM request: no two samples of a chunk, or of two chunks of a step,
share a random stream (vLLM seeds sample j of a prompt with its seed + j)."""

import pytest

from cagrpo_ray.rollout.pool import chunk_sampling
from cagrpo_ray.rollout.vllm_engine import prompt_seed
from cagrpo_ray.schedule import step_seed
from cagrpo_ray.types import SamplingConfig

pytestmark = pytest.mark.unit


def sample_seeds(base: int, prompts: int, n: int) -> list[int]:
    return [prompt_seed(base, p) + j for p in range(prompts) for j in range(n)]


@pytest.mark.parametrize("n", [1, 8, 64])
def test_no_two_samples_of_a_run_share_a_seed(n):
    from cagrpo_ray.config import Config

    config = Config()
    seeds = []
    for step in range(20):
        base = SamplingConfig(n=n, seed=step_seed(config.run.seed, step))
        for start in range(0, 32, 4):  # chunks of 4 prompts
            seeds += sample_seeds(chunk_sampling(base, start).seed, 4, n)
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)


def test_consecutive_seeds_would_have_shared_streams():
    """What the mixed seed avoids: seed + prompt index with vLLM's seed + sample index."""
    naive = [100 + p + j for p in range(4) for j in range(8)]
    assert len(set(naive)) < len(naive)
