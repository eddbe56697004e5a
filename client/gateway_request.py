"""The one object a caller's request travels as through the gateway, from intake to a backend."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import ValidationError

from client.endpoints import Endpoint, ParsedRequest
from client.routing_fields import RoutingFields
from protocol.generation import GenerateRequest
from utils.errors import APIError, validation_api_error
from utils.request_id import new_request_id

if TYPE_CHECKING:
    from client.forwarding.stream_tokens import StreamTokens

#: Where a request may go: ``auto`` (the servers' tiers, then the fallback tier: OpenAI
#: jumpers), ``local`` (never to the fallback tier) or ``openai`` (the fallback tier only).
#: Callers choose with the ``X-LLM-Route`` header.
Route = Literal["auto", "local", "openai"]

__all__ = ["GatewayRequest", "ParsedRequest", "Route", "route_allows"]


def route_allows(route: Route, is_fallback: bool) -> bool:
    """True when a request routed ``route`` may go to a backend of the fallback tier
    (``is_fallback``) or of another tier."""
    return route == "auto" or is_fallback == (route == "openai")


@dataclass(eq=False)
class GatewayRequest:
    """A caller's request, parsed and validated once at intake.

    ``body`` is what our own servers get, unchanged (fields the gateway does not know pass
    through). Other forms are built only when a backend that needs one is asked, and kept:
    ``native`` (the same request in native terms) and its native form. Each backend's plan for
    the request is kept by the forwarding side (``client.backends.plan_memo``).
    """

    endpoint: Endpoint
    parsed: ParsedRequest
    body: bytes = b""
    route: Route = "auto"
    request_id: str = field(default_factory=new_request_id)
    #: The caller's ``X-Session-ID`` header (conversation affinity).
    session_id: str | None = None
    #: Caller headers passed on to the backend (request correlation).
    headers: dict[str, str] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)
    #: The caller's path of a relayed request (``Endpoint.RELAYED``); None otherwise.
    path: str | None = None
    #: ``backend:outcome`` of each attempt so far, for the request's log line.
    attempts: list[str] = field(default_factory=list, repr=False)
    #: A continuation of a broken stream (``protocol.resume``): the stream's tracker, which
    #: the new server's stream goes on feeding. None for a caller's own request.
    resume_tracker: StreamTokens | None = field(default=None, repr=False)
    _native_form: GatewayRequest | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.endpoint = Endpoint(self.endpoint)  # also when built in code with a path string
        if not self.body:  # built in code (tests, translations) rather than received
            self.body = self.parsed.model_dump_json(exclude_unset=True).encode()

    @property
    def model(self) -> str | None:
        """The model asked for (None: any)."""
        return self.parsed.model or None

    @property
    def is_stream(self) -> bool:
        """True when the caller asked for a stream."""
        return self.parsed.stream

    @functools.cached_property
    def _native_or_error(self) -> GenerateRequest | APIError | None:
        if not self.endpoint.has_native_form:
            return None
        parsed = self.parsed
        if isinstance(parsed, RoutingFields):  # read at intake for routing only: read it all
            try:
                parsed = self.endpoint.spec.schema.model_validate_json(self.body)
            except ValidationError as exc:
                return validation_api_error(exc)
        return parsed.to_generate_request()

    @property
    def native(self) -> GenerateRequest | None:
        """The native request that asks the same (itself for ``/generate``), or None when none
        does or the body does not validate (:attr:`native_error` says why); built on first
        use: only backend kinds that translate need the request's full meaning."""
        native = self._native_or_error
        return native if isinstance(native, GenerateRequest) else None

    @property
    def native_error(self) -> APIError | None:
        """The 400 for a body that does not validate against its endpoint's model (None when
        it does)."""
        error = self._native_or_error
        return error if isinstance(error, APIError) else None

    def native_form(self) -> GatewayRequest | None:
        """The same request on the native ``/generate`` endpoint (None when there is none),
        for a backend that does not speak the caller's API; made once."""
        if self._native_form is None and self.native is not None:
            self._native_form = GatewayRequest(
                endpoint=Endpoint.GENERATE,
                parsed=self.native,
                route=self.route,
                request_id=self.request_id,
                session_id=self.session_id,
                headers=self.headers,
                received_at=self.received_at,
            )
        return self._native_form

    @property
    def is_usage_streamed(self) -> bool:
        """An OpenAI stream that must end with a usage chunk (``stream_options``)."""
        return getattr(self.parsed, "is_usage_streamed", False)
