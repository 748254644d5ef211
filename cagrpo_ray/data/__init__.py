"""Task prompts: reasoning_gym and file sources (verl, TRL, OpenRLHF layouts), chat formatting,
worked solutions."""

from cagrpo_ray.data.files import (
    FORMATS,
    BadRow,
    BadRowError,
    FilePromptSource,
    PromptFileError,
    detect_format,
)
from cagrpo_ray.data.prompts import (
    R1_INSTRUCTION,
    PromptTooLongError,
    check_prompt_lengths,
    format_prompt,
    format_prompt_text,
)
from cagrpo_ray.data.reasoning_gym_source import ReasoningGymSource
from cagrpo_ray.data.solutions import worked_solution
from cagrpo_ray.data.types import PromptItem, PromptSource

__all__ = [
    "FORMATS",
    "BadRow",
    "BadRowError",
    "FilePromptSource",
    "PromptFileError",
    "PromptItem",
    "PromptSource",
    "PromptTooLongError",
    "R1_INSTRUCTION",
    "ReasoningGymSource",
    "check_prompt_lengths",
    "detect_format",
    "format_prompt",
    "format_prompt_text",
    "worked_solution",
]
