"""Asking a backend that speaks another API: the request rewritten, the answer read back.

Our servers take every request as the caller sent it. An OpenAI jumper answers a native
``/generate`` request through the OpenAI API, a Triton server through Triton's generate API:
for those the proxy asks the backend for a :class:`Translation` of the request.
"""

from __future__ import annotations

import abc


class StreamTranslator(abc.ABC):
    """Rewrites a stream chunk by chunk (chunks may split or join the backend's events)."""

    @abc.abstractmethod
    def feed(self, data: bytes) -> bytes:
        """What to send the caller for the next bytes of the backend's stream."""

    def close(self) -> bytes:
        """What to send the caller when the backend's stream has ended normally."""
        return b""


class Translation(abc.ABC):
    """One request in the backend's API, and its answer in the caller's."""

    @abc.abstractmethod
    def request(self) -> tuple[str, bytes]:
        """The backend's API path and the JSON body to send there."""

    @abc.abstractmethod
    def answer(self, body: bytes) -> bytes:
        """The caller's JSON answer for the backend's (successful) JSON answer."""

    @abc.abstractmethod
    def stream(self) -> StreamTranslator:
        """A fresh translator for the backend's (successful) stream."""

    def error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """The caller's status and error body for the backend's error answer (by default
        unchanged: our servers and OpenAI-compatible upstreams share the error shape)."""
        return status, body


class SecretScrubber(StreamTranslator):
    """Masks ``secret`` in a stream (after ``inner``'s rewriting), also when a chunk boundary
    splits it: a chunk's tail that could begin the secret waits for the next chunk. Other
    bytes go out at once, so events are not delayed (SSE framing never begins a secret)."""

    def __init__(self, secret: str, inner: StreamTranslator | None = None) -> None:
        self.secret = secret.encode()
        self.inner = inner
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        """The scrubbed bytes that can go out now."""
        return self._scrub(self.inner.feed(data) if self.inner else data, is_last=False)

    def close(self) -> bytes:
        """Whatever was held back, scrubbed, after ``inner``'s closing bytes."""
        return self._scrub(self.inner.close() if self.inner else b"", is_last=True)

    def _scrub(self, data: bytes, is_last: bool) -> bytes:
        text = (self._held + data).replace(self.secret, b"***")
        num_held = 0 if is_last else _longest_prefix_suffix(text, self.secret)
        self._held = text[len(text) - num_held :] if num_held else b""
        return text[: len(text) - num_held]


def _longest_prefix_suffix(text: bytes, secret: bytes) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``secret``."""
    for length in range(min(len(secret) - 1, len(text)), 0, -1):
        if text.endswith(secret[:length]):
            return length
    return 0
