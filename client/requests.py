"""What routing knows about a request: its endpoint, model, route and what it needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    #: Why a Triton server cannot take the request; empty when it can.
    triton_unsupported: tuple[str, ...] = ()
