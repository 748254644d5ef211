"""Multi-turn environments: the policy calls a tool, reads its result and goes on.

`episode.run_episode` drives one episode token in, token out over any engine turn function;
`episode.ToolEnvironment` answers `<tool>name: input</tool>` calls with the tools of
`tools.py` (a calculator, Python in the sandbox). Environment tokens are context, never
trained on: an episode's `from_policy` is the learner's `response_mask`.
"""

from cagrpo_ray.env.episode import Environment, EnvReply, Episode, ToolEnvironment, run_episode
from cagrpo_ray.env.tools import ToolResult, calculate, run_calculator, run_python

__all__ = [
    "EnvReply",
    "Environment",
    "Episode",
    "ToolEnvironment",
    "ToolResult",
    "calculate",
    "run_calculator",
    "run_episode",
    "run_python",
]
