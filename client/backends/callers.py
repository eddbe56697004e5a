"""The caller-side translation of each API, for a backend that answers in native terms."""

from __future__ import annotations

from client.backends.native_as_openai import NativeAsOpenAI
from client.backends.translation import Translation
from client.gateway_request import GatewayRequest
from client.triton.call import TritonCall
from client.triton.from_triton import TritonFromNative


def caller_translation(request: GatewayRequest, inner: Translation | None) -> Translation:
    """The translation that sends ``request``'s native form (worded by ``inner``, the backend
    side's translation, if any) and turns the native answers back into the caller's API."""
    if isinstance(request.parsed, TritonCall):
        return TritonFromNative(request.parsed, inner)
    native = request.native
    assert native is not None  # callers ask only for requests that have a native form
    return NativeAsOpenAI(native, inner, request.endpoint, request.model, request.is_usage_streamed)
