"""What both hardened HTTP protocols (httptools and h11, ``utils.http_protocol``) share: the
connection's deadline timer, its phases, and error answers written straight to the socket.

A connection is in one phase at a time: waiting for a request's headers (the header timeout
runs from the connection's opening, or from the first byte of a later request), reading its
body (idle and total body timeouts), or neither (the app works, or the connection idles under
uvicorn's keep-alive timer). One loop timer (``call_later``) per connection watches the phase.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.server import ServerState

from utils.connection_limits import ConnectionLimits, limits_of
from utils.errors import APIError

logger = logging.getLogger("utils.http_protocol")

#: Bytes a header line costs beyond its name and value (": " and CRLF).
_HEADER_LINE_OVERHEAD = 4
#: How long a rejected connection's remaining upload is read and discarded before closing.
LINGER_SECONDS = 2.0


class ConnectionGuard:
    """Mixin for a uvicorn HTTP protocol (before it in the bases): deadlines and rejections.

    Its ``__init__`` runs the protocol's, then :meth:`_init_guard`; the protocol calls the phase
    hooks
    (``_request_started``, ``_headers_done``, ``_body_seen``, ``_body_done``) as it parses.
    """

    # Provided by the uvicorn protocol this is mixed into.
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    flow: Any
    cycle: Any
    client: tuple[str, int] | None
    connections: set[Any]
    tasks: set[Any]
    server_state: ServerState
    timeout_keep_alive: float
    limit_concurrency: int | None

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)  # type: ignore[call-arg]
        self._init_guard(config.app)

    def _init_guard(self, app: Any) -> None:
        self.limits: ConnectionLimits = limits_of(app)
        self.timeout_keep_alive = self.limits.keep_alive_timeout_seconds
        # Our own cap answers in JSON; uvicorn's check would answer text/plain first.
        self.limit_concurrency = None
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting_headers = True
        self._header_bytes = 0
        self._body_started_at = 0.0
        self._body_seen_at = 0.0
        self._rejection: tuple[int, str, dict[str, str]] | None = None
        self._in_body = False  # between a request's headers and the end of its body
        self._discarding = False  # answered and closing: what still comes is dropped

    # Timer ----------------------------------------------------------------------------------
    # Shared protocol hooks (this mixin comes first in both protocols' bases) ----------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accept the connection; its headers must be complete within the header timeout."""
        super().connection_made(transport)  # type: ignore[misc]
        self._arm(self.limits.header_timeout_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timer with the connection."""
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        """Answered: keep-alive as usual, unless the body was still coming."""
        if not self._answered_early():
            super().on_response_complete()  # type: ignore[misc]

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._on_deadline)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_deadline(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._awaiting_headers:
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined request waits for the answer before it: its clock is not running.
                self._arm(self.limits.header_timeout_seconds)
            elif self._header_bytes:
                self._reject(408, "the request headers did not arrive in time")
            else:
                self.transport.close()  # nothing asked yet: close quietly, like keep-alive
            return
        if self.flow.read_paused:
            # The app has not read what it got: the client is not the one who is slow.
            self._body_seen_at = now
            self._arm(self.limits.body_idle_timeout_seconds)
            return
        deadline = min(
            self._body_seen_at + self.limits.body_idle_timeout_seconds,
            self._body_started_at + self.limits.body_timeout_seconds,
        )
        if now < deadline:
            # A chunk came since the timer was armed: wait for the rest of the allowance
            # (one timer per body instead of one per chunk).
            self._arm(deadline - now)
            return
        self._reject(408, "the request body did not arrive in time")

    # Phases ---------------------------------------------------------------------------------
    def _request_started(self) -> None:
        """A request's first byte: its headers get the header timeout (the first request's
        timer runs from the connection's opening already)."""
        self._awaiting_headers = True
        self._header_bytes = 0
        if self._timer is None:
            self._arm(self.limits.header_timeout_seconds)

    def _over_capacity(self) -> bool:
        """Past the cap (``connections`` includes this one; ``tasks`` not its request yet):
        the rejection is chosen, the caller stops the request."""
        cap = self.limits.max_connections
        if len(self.connections) > cap or len(self.tasks) >= cap:
            message = f"the server holds its limit of {cap} connections; retry shortly"
            self._rejection = (503, message, {"Retry-After": "1"})
            return True
        return False

    def _headers_over_limit(self, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Measure headers that arrived whole (the parsers bound only unfinished ones): past
        ``max_header_bytes`` the 431 is chosen and True returned, the caller stops the request."""
        size = len(target) + sum(
            len(name) + len(value) + _HEADER_LINE_OVERHEAD for name, value in headers
        )
        if size > self.limits.max_header_bytes:
            self._rejection = (431, self._too_large_message(), {})
            return True
        return False

    def _headers_done(self) -> None:
        """Headers complete: the body's clock starts."""
        self._awaiting_headers = False
        self._in_body = True
        self._body_started_at = self._body_seen_at = self.loop.time()
        self._arm(self.limits.body_idle_timeout_seconds)

    def _body_seen(self) -> None:
        self._body_seen_at = self.loop.time()

    def _body_done(self) -> None:
        """The body is complete: no timer runs while the app works on the request."""
        self._disarm()
        self._in_body = False

    def _close_if_answered_mid_body(self, cycle: Any) -> None:
        """Make an answer that starts while the body is still coming say ``connection:
        close`` (uvicorn adds it when the cycle is not keep-alive): ``_answered_early`` then
        closes the connection, and the client must not reuse it for its next request."""
        send = cycle.send

        async def send_and_mark(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and self._in_body:
                cycle.keep_alive = False
            await send(message)

        cycle.send = send_and_mark

    def _answered_early(self) -> bool:
        """Call when an answer completes. A request answered before its body ended (a 413)
        closes its connection rather than reading an upload nobody wants; True if so.
        (With pipelining the answer may be an older request's: then the connection goes on.)"""
        if self._in_body and self.cycle is not None and self.cycle.response_complete:
            if not self.transport.is_closing():
                self._disarm()
                self._discarding = True
                self._linger()
            return True
        return False

    # Answers --------------------------------------------------------------------------------
    def _too_large_message(self) -> str:
        limit = self.limits.max_header_bytes
        return f"the request headers are larger than the limit of {limit} bytes"

    def _reject(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._rejection = (status, message, headers or {})
        self._send_rejection()

    def _send_rejection(self) -> None:
        """Write the chosen error answer (unless the app already answered) and close."""
        assert self._rejection is not None
        status, message, headers = self._rejection
        self._disarm()
        if self.transport.is_closing():
            return
        self._discarding = True
        cycle = self.cycle
        in_request = self._in_body and cycle is not None
        if in_request and not cycle.response_complete:
            # The app stops here: its receive() gets http.disconnect, its send() is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        if not (in_request and cycle.response_started):
            self.transport.write(error_bytes(status, message, headers, self.server_state))
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        logger.info("%s: HTTP %d %s; connection closed", client, status, message)
        self._linger()

    def _linger(self) -> None:
        """Close after the client has read the answer: a close while its upload is still
        coming resets the connection, and the reset destroys the answer in the client's
        buffer (it sees a broken pipe). So: end our side, discard what still comes, and
        close when the client does or after ``LINGER_SECONDS``."""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()
            return
        self.flow.resume_reading()
        self._timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)


def error_bytes(
    status: int, message: str, headers: dict[str, str], server_state: ServerState
) -> bytes:
    """A whole HTTP/1.1 answer carrying the error shape, ending the connection."""
    body = APIError(status, message).to_response().model_dump_json().encode()
    lines = [STATUS_LINE[status]]
    for name, value in server_state.default_headers:
        lines.extend([name, b": ", value, b"\r\n"])
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.extend(
        [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )
    return b"".join(lines)
