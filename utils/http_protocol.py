"""uvicorn's HTTP protocols (httptools and h11) with connection limits and answers in the
project's error shape.

uvicorn answers a request it cannot parse with ``text/plain`` "Invalid HTTP request
received.", lets httptools buffer headers of any size, keeps a connection that trickles a byte
a second forever and answers its concurrency limit with ``text/plain``. These protocols
(passed as ``http=`` to uvicorn, see ``utils.serving``) instead:

- answer bad requests 400 and oversized headers 431 in the JSON error shape;
- close a connection whose headers are not complete ``header_timeout_seconds`` after it
  opened (or after the first byte of a later request), and one whose body pauses longer than
  ``body_idle_timeout_seconds`` or takes longer than ``body_timeout_seconds`` in all, with 408;
- close idle keep-alive connections after ``keep_alive_timeout_seconds``;
- answer 503 with ``Retry-After`` beyond ``max_connections``.

The timers and answers are ``utils.connection_guard``'s; here, the parser hooks.
"""

from __future__ import annotations

import sys
from typing import Any

import h11
import httptools
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from utils.connection_guard import ConnectionGuard


class _Rejected(Exception):
    """Raised inside a parser callback to stop parsing; the answer is already chosen."""


class HardenedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
    """``HttpToolsProtocol`` with header/body/keep-alive timeouts, a header size limit, a
    connection cap and JSON error answers. Limits come from the served app's state."""

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

    def on_message_begin(self) -> None:
        """A new request: its header clock starts."""
        super().on_message_begin()
        self._request_started()

    def on_headers_complete(self) -> None:
        """Check size and the connection cap, then start the app and the body's timer."""
        if self._headers_over_limit(self.url, self.headers) or self._over_capacity():
            raise _Rejected
        super().on_headers_complete()
        self._headers_done()
        self._close_if_answered_mid_body(self.cycle)

    def on_body(self, body: bytes) -> None:
        """Pass the chunk on; the body timer sees it at its next deadline."""
        self._body_seen()
        super().on_body(body)

    def on_message_complete(self) -> None:
        """The body is complete."""
        self._body_done()
        super().on_message_complete()


class _WatchedConnection(h11.Connection):
    """An h11 connection that tells the protocol what it parsed (h11 has no callbacks)."""

    def __init__(self, protocol: HardenedH11Protocol, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.protocol = protocol

    def next_event(self) -> Any:
        """The next event, with the protocol's phase hooks run on it."""
        event = super().next_event()
        protocol = self.protocol
        if isinstance(event, h11.Request):
            # h11 bounds only unfinished headers; ones that came whole are measured here.
            protocol._headers_over_limit(event.target, event.headers)
            if protocol._rejection is not None or protocol._over_capacity():
                # uvicorn answers a RemoteProtocolError through send_400_response, which
                # sends the rejection chosen here instead.
                raise h11.RemoteProtocolError("rejected")
            protocol._headers_done()
        elif isinstance(event, h11.Data):
            protocol._body_seen()
        elif isinstance(event, h11.EndOfMessage):
            protocol._body_done()
            protocol._awaiting_headers = True  # whatever comes next is the next request
            protocol._header_bytes = 0
        return event


class HardenedH11Protocol(ConnectionGuard, H11Protocol):
    """``H11Protocol`` with the same limits and answers as ``HardenedHttpToolsProtocol``
    (h11 bounds unfinished headers itself, at ``max_header_bytes``)."""

    def _init_guard(self, app: Any) -> None:
        """The guard's state, and an h11 connection that reports its events to it (replacing
        uvicorn's, made in ``H11Protocol.__init__`` just before)."""
        super()._init_guard(app)
        self.conn = _WatchedConnection(self, self.limits.max_header_bytes)

    def data_received(self, data: bytes) -> None:
        """Feed h11, starting a request's header clock at its first byte."""
        if self._discarding:
            return
        if self._awaiting_headers:
            if not self._header_bytes:
                self._request_started()
            self._header_bytes += len(data)
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 refused, in the error shape (431 where h11 says so)."""
        if self._rejection is None:
            exc = sys.exc_info()[1]  # called from uvicorn's ``except RemoteProtocolError``
            status = getattr(exc, "error_status_hint", 400)
            if status == 431:
                self._reject(431, self._too_large_message())
                return
            self._reject(400, f"invalid HTTP request: {exc or msg}")
            return
        self._send_rejection()
