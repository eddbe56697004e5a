"""uvicorn's httptools protocol with connection limits and answers in the project's error shape.

uvicorn answers a request it cannot parse with ``text/plain`` "Invalid HTTP request
received.", buffers headers of any size, keeps a connection that trickles a byte a second
forever and answers its concurrency limit with ``text/plain``. This protocol (passed as
``http=`` to uvicorn, see ``utils.serving``) instead:

- answers bad requests 400 and oversized headers 431 in the JSON error shape;
- closes a connection whose headers are not complete ``header_timeout_seconds`` after it
  opened (or after the first byte of a later request), and one whose body pauses longer than
  ``body_idle_timeout_seconds`` or takes longer than ``body_timeout_seconds`` in all, with 408;
- closes idle keep-alive connections after ``keep_alive_timeout_seconds``;
- answers 503 with ``Retry-After`` beyond ``max_connections``.

Timers are loop timers (``call_later``), one per connection at a time, armed per phase.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from utils.connection_limits import limits_of
from utils.errors import APIError

logger = logging.getLogger(__name__)

#: How long a rejected connection's remaining upload is read and discarded before closing.
_LINGER_SECONDS = 2.0
#: Bytes a header line costs beyond its name and value (": " and CRLF).
_HEADER_LINE_OVERHEAD = 4


class _Rejected(Exception):
    """Raised inside a parser callback to stop parsing; the answer is already chosen."""


class HardenedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` with header/body/keep-alive timeouts, a header size limit, a
    connection cap and JSON error answers. Limits come from the served app's state."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits_of(config.app)
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

    # Timers ---------------------------------------------------------------------------------
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
            if self._header_bytes:
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

    # Connection life ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accept the connection; its headers must be complete within the header timeout."""
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timer with the connection."""
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; bad input and oversized headers are answered in the error shape."""
        self._unset_keepalive_if_required()
        if self._discarding:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # As uvicorn does (our apps serve no websockets, so this is a warning in practice).
            if self._should_upgrade():
                self._disarm()
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            if self._rejection is None:
                self._reject(400, f"invalid HTTP request: {exc}")
            else:
                self._send_rejection()
            return
        if self._awaiting_headers:
            # httptools buffers an unfinished header line whole: bound what it may hold.
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._reject(431, self._too_large_message())

    # Parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        """A new request: its headers get the header timeout from its first byte (the first
        request's timer runs from the connection's opening already)."""
        super().on_message_begin()
        self._awaiting_headers = True
        self._header_bytes = 0
        if self._timer is None:
            self._arm(self.limits.header_timeout_seconds)

    def on_headers_complete(self) -> None:
        """Check size and the connection cap, then start the app and the body's timer."""
        size = len(self.url) + sum(
            len(name) + len(value) + _HEADER_LINE_OVERHEAD for name, value in self.headers
        )
        if size > self.limits.max_header_bytes:
            self._rejection = (431, self._too_large_message(), {})
            raise _Rejected
        # ``connections`` includes this one; ``tasks`` does not include its request yet.
        cap = self.limits.max_connections
        if len(self.connections) > cap or len(self.tasks) >= cap:
            message = f"the server holds its limit of {cap} connections; retry shortly"
            self._rejection = (503, message, {"Retry-After": "1"})
            raise _Rejected
        self._awaiting_headers = False
        self._in_body = True
        super().on_headers_complete()
        self._body_started_at = self._body_seen_at = self.loop.time()
        self._arm(self.limits.body_idle_timeout_seconds)

    def on_body(self, body: bytes) -> None:
        """Pass the chunk on; the body timer sees it at its next deadline."""
        self._body_seen_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The body is complete: no timer runs while the app works on the request."""
        self._disarm()
        self._in_body = False
        super().on_message_complete()

    def on_response_complete(self) -> None:
        """Answered; a request answered before its body ended (a 413) closes its connection
        rather than reading the rest of an upload nobody wants."""
        # (With pipelining, the answer that completed may be an older request's: then the
        # current cycle is not complete, and the connection goes on.)
        answered_early = self._in_body and self.cycle is not None and self.cycle.response_complete
        if answered_early and not self.transport.is_closing():
            self._disarm()
            self._discarding = True
            self._linger()
            return
        super().on_response_complete()

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
            self.transport.write(_error_bytes(status, message, headers, self.server_state))
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        logger.info("%s: HTTP %d %s; connection closed", client, status, message)
        self._linger()

    def _linger(self) -> None:
        """Close after the client has read the answer: a close while its upload is still
        coming resets the connection, and the reset destroys the answer in the client's
        buffer (it sees a broken pipe). So: end our side, discard what still comes, and
        close when the client does or after ``_LINGER_SECONDS``."""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()
            return
        self.flow.resume_reading()
        self._timer = self.loop.call_later(_LINGER_SECONDS, self.transport.close)


def _error_bytes(
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
