"""Config sections every model server shares."""

from __future__ import annotations

from pydantic import Field

from server.common.service import ServingSettings
from utils.config import ConfigSection
from utils.connection_limits import ConnectionLimits


class ServingConfig(ConnectionLimits, ConfigSection):
    """``serving_config``: HTTP-level defaults applied to every request, and the HTTP
    connection limits (``header_timeout_seconds`` ...)."""

    default_max_new_tokens: int = Field(
        default=256, ge=1, description="new tokens when a request does not say"
    )
    request_timeout_seconds: float = Field(
        default=600.0, gt=0.0, description="a request running longer is aborted (504)"
    )
    max_request_bytes: int = Field(
        default=1_000_000, gt=0, description="larger request bodies are refused (413)"
    )

    def settings(self, model_id: str) -> ServingSettings:
        """The HTTP layer's settings for a server answering as ``model_id``."""
        return ServingSettings(
            served_model_names=[model_id],
            default_max_new_tokens=self.default_max_new_tokens,
            request_timeout_seconds=self.request_timeout_seconds,
            max_request_bytes=self.max_request_bytes,
            connection_limits=ConnectionLimits.of(self),
        )
