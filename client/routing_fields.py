"""What the gateway reads of a JSON body: the fields it routes on, nothing else.

The gateway forwards every body as it came. It reads the model (routing), ``stream`` and
``stream_options`` (how to relay the answer), and ``user``, ``prompt`` and ``messages`` (session
affinity); a body whose routing fields are malformed gets a 400 naming the field. Every other
field is the backend's to judge: our servers answer for themselves, an OpenAI-compatible
upstream gets ``tools``, ``logprobs``, ``response_format`` and fields unknown to us untouched.
A backend kind that must translate the request reads its full meaning only then
(``GatewayRequest.native``), and declines when that fails.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator


class RoutedMessage(BaseModel):
    """One chat message, as far as affinity reads it (its role; the rest as sent)."""

    model_config = ConfigDict(extra="allow")

    role: str | None = None


class RoutedStreamOptions(BaseModel):
    """``stream_options``: whether a stream ends with a usage chunk."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


class RoutingFields(BaseModel):
    """The routing fields of a native, OpenAI (chat) completion or embeddings body."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    stream_options: RoutedStreamOptions | None = None
    user: str | None = None
    prompt: object = None
    messages: list[RoutedMessage] | None = None

    @field_validator("stream", mode="before")
    @classmethod
    def _null_is_false(cls, value: object) -> object:
        return False if value is None else value

    @property
    def is_usage_streamed(self) -> bool:
        """True when the last stream chunk must carry usage (``stream_options``)."""
        return bool(self.stream_options and self.stream_options.include_usage)
