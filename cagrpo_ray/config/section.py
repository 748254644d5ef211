"""The base of every configuration section: unknown keys are refused, and assignments checked."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
