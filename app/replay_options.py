"""What `stepline experts replay` was asked, as one validated value (a module of its own, so the
command line imports pydantic's machinery only for the command that needs it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ReplayOptions(BaseModel):
    """What `stepline experts replay` was asked, validated before any work."""

    model_config = ConfigDict(extra="forbid")

    slots: list[int] = Field(min_length=1)
    policies: list[str] = Field(min_length=1)
    prefetch: int = Field(ge=0, le=64)
    copy_cost: float = Field(gt=0, le=100)
    min_confidence: float = Field(ge=0, le=1)
    allocation: Literal["uniform", "reuse"]

    @field_validator("slots")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(s < 1 for s in value):
            raise ValueError("every slots-per-layer size must be at least 1")
        return sorted(set(value))
