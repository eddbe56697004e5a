"""Caller authentication: optional API keys sent as ``Authorization: Bearer <key>``."""

from __future__ import annotations

import hashlib
import hmac

from pydantic import SecretStr

from utils.errors import APIError

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _digest(value: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison time independent of the key length.
    return hashlib.sha256(value.encode()).digest()


def check_caller(authorization: str | None, api_keys: list[SecretStr]) -> None:
    """Accept the request when no keys are configured or it carries one of them; else 401.

    The error never repeats what the caller sent (it may be a real key of another service).
    """
    if not api_keys:
        return
    if not authorization:
        raise APIError(
            401,
            "this gateway requires an API key: send 'Authorization: Bearer <key>'",
            headers=_CHALLENGE,
        )
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "the Authorization header must be 'Bearer <key>'", headers=_CHALLENGE)
    offered = _digest(token.strip())
    # Check every key (no early exit) so the time taken does not tell which one was close.
    is_known = False
    for key in api_keys:
        is_known |= hmac.compare_digest(offered, _digest(key.get_secret_value()))
    if not is_known:
        raise APIError(401, "the API key is not valid for this gateway", headers=_CHALLENGE)
