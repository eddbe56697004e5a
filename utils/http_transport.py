"""An httpx transport whose connection failures are always httpx errors.

httpcore's anyio backend reads socket attributes (``getpeername``) of a connection right after
opening it and when it checks a pooled one; when the peer reset the connection in between (a
server SIGKILLed under load), the transport has already dropped its socket and the read raises
``AttributeError: 'NoneType' object has no attribute 'getpeername'`` instead of an httpx error.
A caller that fails over on ``httpx.ConnectError`` (the gateway) would answer 500 instead.
"""

from __future__ import annotations

import httpx


class ResetSafeTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` that reports a connection broken while it is being opened
    or taken from the pool as :class:`httpx.ConnectError` (nothing was sent on it yet)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request``; a socket that vanished under the connection is a ConnectError."""
        try:
            return await super().handle_async_request(request)
        except (AttributeError, OSError) as exc:
            message = f"the connection broke while it was being opened ({exc!r})"
            raise httpx.ConnectError(message, request=request) from exc
