"""Limits on what one HTTP connection may hold: config keys shared by the gateway and servers.

A slow or idle client (slowloris) costs a socket, a protocol object and parser buffers for as
long as the server lets it; these limits bound that time and the number of such connections.
They are enforced in the HTTP protocol itself (``utils.http_protocol``), which reads them from
``app.state.connection_limits`` (set by each app's ``build_app``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

#: Where an app keeps its limits for the protocol to find.
STATE_ATTRIBUTE = "connection_limits"


class ConnectionLimits(BaseModel):
    """HTTP connection limits. Config models inherit these keys (flat, as the gateway's config
    is, or inside ``serving_config`` on the servers)."""

    header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="longest time from a connection's opening (or a request's first byte) to "
        "the end of its headers; then 408 and the connection is closed",
    )
    body_idle_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="longest silence between two pieces of a request body; then 408 and close",
    )
    body_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="longest time a whole request body may take (a byte-a-second body is "
        "never silent for long); then 408 and close",
    )
    keep_alive_timeout_seconds: float = Field(
        default=5.0, gt=0, description="an idle keep-alive connection is closed after this"
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        description="open connections (or requests in flight) beyond which a request is "
        "answered 503 with Retry-After and its connection closed",
    )
    max_header_bytes: int = Field(
        default=65_536,
        ge=1024,
        description="request line and headers larger than this answer 431",
    )

    @classmethod
    def of(cls, config: Any) -> ConnectionLimits:
        """The limits held by ``config`` (any model that inherits these keys)."""
        return cls(**{name: getattr(config, name) for name in cls.model_fields})


def limits_of(app: Any) -> ConnectionLimits:
    """The limits the app set in its state, else the defaults (an app of tests, say)."""
    state = getattr(app, "state", None)
    limits = getattr(state, STATE_ATTRIBUTE, None)
    return limits if isinstance(limits, ConnectionLimits) else ConnectionLimits()


def set_limits(app: Any, limits: ConnectionLimits) -> None:
    """Keep ``limits`` on the app for the HTTP protocol that serves it."""
    setattr(app.state, STATE_ATTRIBUTE, limits)
