"""One translation interface for both directions between the caller's API and a backend's.

A backend that speaks the caller's API takes the request as sent (the same API passes through
untouched). Otherwise a :class:`Translation` rewrites the request and reads the answer back:

- backend side: a native request in the backend's API (an OpenAI-compatible upstream answers
  ``/generate`` through the OpenAI API, a Triton server through Triton's generate API);
- caller side (:class:`CallerTranslation`): a caller of another API (OpenAI, Triton) served by
  a backend that answers in native terms: the request's native form goes out (through the
  backend side's translation, if any) and the native answers come back in the caller's API.
"""

from __future__ import annotations

import abc
import json

from protocol.generation import GenerateRequest
from utils.text import num_held_back


class StreamTranslator(abc.ABC):
    """Rewrites a stream chunk by chunk (chunks may split or join the backend's events)."""

    @abc.abstractmethod
    def feed(self, data: bytes) -> bytes:
        """What to send the caller for the next bytes of the backend's stream."""

    def close(self) -> bytes:
        """What to send the caller when the backend's stream has ended normally."""
        return b""

    def error_event(self, event: bytes) -> bytes:
        """The caller's form of an error event the gateway adds to the stream (in the
        suite's error shape: OpenAI's); by default the same."""
        return event


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

    def media_type(self, upstream: str) -> str:
        """The content type of a whole answer, given the backend's (by default the same)."""
        return upstream


class CallerTranslation(Translation):
    """A caller of another API served by a backend that answers in native terms.

    The request that goes out is the caller's request in native form (``native``), worded by
    the backend side's translation ``inner`` when the backend needs one; what comes back is
    read by ``inner`` first, then turned into the caller's API by the subclass.
    """

    def __init__(self, native: GenerateRequest, inner: Translation | None) -> None:
        self.native = native
        self.inner = inner

    def request(self) -> tuple[str, bytes]:
        """The native form, as the backend side words it (a native backend: as it is)."""
        if self.inner is not None:
            return self.inner.request()
        return "/generate", self.native.model_dump_json(exclude_none=True).encode()

    def answer(self, body: bytes) -> bytes:
        """The caller's answer for the backend's."""
        native = self.inner.answer(body) if self.inner is not None else body
        return self.from_native(json.loads(native))

    def stream(self) -> StreamTranslator:
        """The backend side's stream translator, then the caller's."""
        inner = self.inner.stream() if self.inner is not None else None
        return ChainedStream(inner, self.stream_from_native())

    def error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """The backend side's reading of the error, in the caller's error shape."""
        if self.inner is not None:
            status, body = self.inner.error(status, body)
        return self.error_from_native(status, body)

    @abc.abstractmethod
    def from_native(self, answer: dict) -> bytes:
        """The caller's answer for a native answer."""

    @abc.abstractmethod
    def stream_from_native(self) -> StreamTranslator:
        """A fresh translator from a native stream to the caller's."""

    def error_from_native(self, status: int, body: bytes) -> tuple[int, bytes]:
        """The caller's error for a native one (by default the same: OpenAI's shape)."""
        return status, body


class ChainedStream(StreamTranslator):
    """``inner`` then ``outer``: every byte goes through both, in that order."""

    def __init__(self, inner: StreamTranslator | None, outer: StreamTranslator) -> None:
        self.inner = inner
        self.outer = outer

    def feed(self, data: bytes) -> bytes:
        """The bytes ``outer`` makes of what ``inner`` makes of ``data``."""
        return self.outer.feed(self.inner.feed(data) if self.inner is not None else data)

    def close(self) -> bytes:
        """``inner``'s last bytes through ``outer``, then ``outer``'s last bytes."""
        tail = self.outer.feed(self.inner.close()) if self.inner is not None else b""
        return tail + self.outer.close()

    def error_event(self, event: bytes) -> bytes:
        """The event in ``outer``'s form (``inner`` reads the backend's API, not ours)."""
        return self.outer.error_event(event)


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

    def error_event(self, event: bytes) -> bytes:
        """``inner``'s form of the gateway's event (which quotes no secret)."""
        return self.inner.error_event(event) if self.inner else event

    def _scrub(self, data: bytes, is_last: bool) -> bytes:
        text = (self._held + data).replace(self.secret, b"***")
        num_held = 0 if is_last else num_held_back(text, [self.secret])
        self._held = text[len(text) - num_held :] if num_held else b""
        return text[: len(text) - num_held]
