"""The base of the apps' pure ASGI middleware.

Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``: streaming answers and client
disconnects pass through untouched. What is not an HTTP request (the lifespan, websockets),
or not of the methods a middleware wants, goes straight to the app.
"""

from __future__ import annotations

from typing import ClassVar

from starlette.types import ASGIApp, Receive, Scope, Send


class HttpMiddleware:
    """ASGI middleware that sees HTTP requests only: subclasses write ``handle``."""

    #: The request methods ``handle`` sees (None: every method).
    methods: ClassVar[frozenset[str] | None] = None

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (
            self.methods is not None and scope["method"] not in self.methods
        ):
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one HTTP request, calling ``self.app`` for the answer."""
        raise NotImplementedError
