"""The one error shape every app answers with: ``{"error": {"type", "message", "code"}}``."""

from __future__ import annotations

from pydantic import BaseModel

# Error types, in the spirit of OpenAI's: clients branch on these strings.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
AUTHENTICATION = "authentication_error"
OVERLOADED = "overloaded_error"
TIMEOUT = "timeout_error"
UPSTREAM = "upstream_error"
INTERNAL = "internal_error"
#: A request failed inside the server because of what it holds, the server itself is fine:
#: gateways neither retry it elsewhere nor count it against the server.
REQUEST_FAILED = "request_failed_error"


class ErrorDetail(BaseModel):
    """What went wrong: a machine-readable type, a human message, the HTTP status as code."""

    type: str
    message: str
    code: int
    param: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail
