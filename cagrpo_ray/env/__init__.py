"""Multi-turn environments: the policy calls a tool, reads its result and goes on.

`episode.run_episodes` plays a request's episodes token in, token out on an engine (each
episode `episode.run_episode`);
`episode.ToolEnvironment` answers `<tool>name: input</tool>` calls with the tools of
`tools.py` (a calculator, Python in the sandbox). Environment tokens are context, never
trained on: an episode's `from_policy` is the learner's `response_mask`.
"""

from cagrpo_ray.env.episode import (
    Environment,
    EnvReply,
    Episode,
    EpisodePlayer,
    ToolEnvironment,
    environment_options,
    run_episode,
    run_episodes,
)
from cagrpo_ray.env.tools import ToolResult, calculate, run_calculator, run_python

__all__ = [
    "EnvReply",
    "Environment",
    "Episode",
    "EpisodePlayer",
    "ToolEnvironment",
    "ToolResult",
    "calculate",
    "run_calculator",
    "environment_options",
    "run_episode",
    "run_episodes",
    "run_python",
]
