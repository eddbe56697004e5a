"""Request planning: whether a backend takes a request, and in which form."""

from __future__ import annotations

from dataclasses import dataclass

from client.backends.translation import Translation
from client.endpoints import Endpoint
from client.gateway_request import GatewayRequest
from utils.errors import APIError


@dataclass(frozen=True)
class Plan:
    """How a backend would take a request: refused (``refusal`` says why), or in which form
    (``translation``; None: the caller's body goes unchanged, to ``path`` when the backend's
    path differs from the caller's, as the model in a Triton path does)."""

    refusal: str | None = None
    translation: Translation | None = None
    path: str | None = None
    #: For a refusal because the body is invalid in the meaning the backend needs: the 400
    #: the caller gets when every backend refuses so.
    error: APIError | None = None

    @property
    def is_accepted(self) -> bool:
        """True when the backend can take the request."""
        return self.refusal is None


#: The caller's request, as sent.
AS_SENT = Plan()


def without_native_form(request: GatewayRequest, noun: str) -> Plan:
    """The refusal of a kind that needs ``request``'s native form when there is none: the body
    is invalid (the caller gets its 400 if no backend takes the request as sent), or it asks
    what the native API cannot (embeddings, several prompts, token-id prompts)."""
    error = request.native_error
    if error is not None:
        return Plan(refusal=error.message, error=error)
    if request.endpoint == Endpoint.EMBEDDINGS:
        return Plan(refusal=f"{noun}s do not answer {request.endpoint}")
    return Plan(refusal=f"{noun}s take one text prompt or one conversation per request")
