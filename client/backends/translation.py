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
