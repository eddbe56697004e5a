"""What routing knows about a request: its endpoint, model, route and what it needs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from protocol.generation import GenerateRequest

#: Where a request may go: ``auto`` (our servers and Triton servers, then the OpenAI jumpers as
#: a fallback), ``local`` (never to a jumper) or ``openai`` (the jumpers only). Callers choose
#: with the ``X-LLM-Route`` header.
Route = Literal["auto", "local", "openai"]


@dataclass(frozen=True)
class RequestInfo:
    """What routing may know about a request when choosing a backend."""

    endpoint: str
    model: str | None
    is_stream: bool = False
    #: Where the request may go (``X-LLM-Route``).
    route: Route = "auto"
    #: Requests with the same key belong to one conversation (see ``affinity_key_of``).
    affinity_key: str | None = None
    #: Why an OpenAI-compatible upstream cannot honour the request (the fields it uses that
    #: the OpenAI API lacks); empty when it can.
    upstream_unsupported: tuple[str, ...] = ()
    #: Why a Triton server cannot take the request (besides chat); empty when it can.
    triton_unsupported: tuple[str, ...] = ()
    #: The request is a conversation (``messages``) rather than a prompt.
    is_chat: bool = False
    #: A native request says the same (``ForwardRequest.native``): backends that translate
    #: requests can take it.
    has_native: bool = False
    #: An OpenAI stream that must end with a usage chunk (``stream_options.include_usage``).
    is_usage_streamed: bool = False


@dataclass
class ForwardRequest:
    """A validated caller request, ready to forward: the original body is sent unchanged."""

    info: RequestInfo
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    received_at: float = field(default_factory=time.monotonic)
    #: The same request in native terms, for backends that need it translated.
    native: GenerateRequest | None = None
