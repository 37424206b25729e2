"""``[canary]``: one canary group rolled out against one stable group (``gateway.canary``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RolloutSection(Section):
    """Automatic, step-wise canary rollout with analysis against the stable group."""

    enabled: bool = False
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 50.0, 100.0)
    min_requests: int = Field(default=100, ge=1, description="canary requests per step window")
    interval: float = Field(default=60.0, ge=0, description="least seconds per step")
    # Roll back when the canary's error rate exceeds stable's by more than this (absolute).
    max_error_rate_increase: float = Field(default=0.02, ge=0, le=1)
    # Roll back when the canary's TTFT p95 exceeds stable's times this, plus the slack.
    max_ttft_p95_ratio: float = Field(default=1.5, ge=1.0)
    ttft_slack_ms: float = Field(default=50.0, ge=0)

    @field_validator("steps")
    @classmethod
    def _steps(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if not steps or any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(
                set(steps)):
            raise ValueError("must be increasing percentages in (0, 100]")
        return steps


class CanarySection(Section):
    """One canary group rolled out against one stable group."""

    enabled: bool = False
    stable: str = "stable"
    group: str = "canary"
    weight: float = Field(default=0.0, ge=0, le=100, description="canary percentage at start")
    shadow: float = Field(default=0.0, ge=0, le=100,
                          description="percentage of stable traffic mirrored to the canary")
    sync_interval: float = Field(default=0.25, gt=0, le=5)
    rollout: RolloutSection = RolloutSection()
