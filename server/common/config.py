"""Config sections every model server shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server.common.service import ServingSettings


class ServingConfig(BaseModel):
    """``serving_config``: HTTP-level defaults applied to every request."""

    model_config = ConfigDict(extra="forbid")

    default_max_new_tokens: int = Field(
        default=256, ge=1, description="new tokens when a request does not say"
    )
    request_timeout_seconds: float = Field(
        default=600.0, gt=0.0, description="a request running longer is aborted (504)"
    )

    def settings(self, model_id: str) -> ServingSettings:
        """The HTTP layer's settings for a server answering as ``model_id``."""
        return ServingSettings(
            served_model_names=[model_id],
            default_max_new_tokens=self.default_max_new_tokens,
            request_timeout_seconds=self.request_timeout_seconds,
        )
