"""The one object a caller's request travels as through the gateway, from intake to a backend."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Literal

from protocol.embeddings import EmbeddingRequest
from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from utils.request_id import new_request_id

#: Where a request may go: ``auto`` (our servers and Triton servers, then the OpenAI jumpers as
#: a fallback), ``local`` (never to a jumper) or ``openai`` (the jumpers only). Callers choose
#: with the ``X-LLM-Route`` header.
Route = Literal["auto", "local", "openai"]

#: The request bodies the gateway routes.
ParsedRequest = GenerateRequest | CompletionRequest | ChatCompletionRequest | EmbeddingRequest


@dataclass(eq=False)
class GatewayRequest:
    """A caller's request, parsed and validated once at intake.

    ``body`` is what our own servers get, unchanged (fields the gateway does not know pass
    through). Other forms are built only when a backend that needs one is asked, and kept:
    ``native`` (the same request in native terms) and each backend's :class:`Plan` (whether it
    takes the request, and its translation), so failover and retries reuse them.
    """

    endpoint: str
    parsed: ParsedRequest
    body: bytes = b""
    route: Route = "auto"
    request_id: str = field(default_factory=new_request_id)
    #: The caller's ``X-Session-ID`` header (conversation affinity).
    session_id: str | None = None
    #: Caller headers passed on to the backend (request correlation).
    headers: dict[str, str] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)
    #: ``backend:outcome`` of each attempt so far, for the request's log line.
    attempts: list[str] = field(default_factory=list, repr=False)
    #: Each asked backend's plan for this request: backend -> ``client.backends.base.Plan``,
    #: kept by ``Backend.plan_for`` (typed loosely so that this module imports no backend).
    plans: dict[object, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
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
    def native(self) -> GenerateRequest | None:
        """The native request that asks the same (itself for ``/generate``), or None when none
        does; built on first use (only backends that translate need it)."""
        return self.parsed.to_generate_request()

    @property
    def is_usage_streamed(self) -> bool:
        """An OpenAI stream that must end with a usage chunk (``stream_options``)."""
        return getattr(self.parsed, "is_usage_streamed", False)
