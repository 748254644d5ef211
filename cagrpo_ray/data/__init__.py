"""Task prompts: reasoning_gym and file sources, chat formatting, worked solutions."""

from cagrpo_ray.data.files import BadRow, BadRowError, FilePromptSource, PromptFileError
from cagrpo_ray.data.prompts import R1_INSTRUCTION, format_prompt, format_prompt_text
from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.data.solutions import worked_solution
from cagrpo_ray.data.types import PromptItem, PromptSource

__all__ = [
    "BadRow",
    "BadRowError",
    "FilePromptSource",
    "PromptFileError",
    "PromptItem",
    "PromptSource",
    "R1_INSTRUCTION",
    "ReasoningGymSource",
    "format_prompt",
    "format_prompt_text",
    "worked_solution",
]
