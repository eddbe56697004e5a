"""Triton Inference Server (e.g. Triton + TensorRT-LLM) as a backend of the gateway.

Heartbeats use Triton's ready endpoints (``/v2/health/ready``, then ``/v2/models/{m}/ready``
for each configured model); native ``/generate`` requests with a ``prompt`` go through
Triton's generate extension (``/v2/models/{m}/generate`` or ``generate_stream``) and the answer
comes back in the native shape. Balancing, failover and the circuit breaker treat a Triton
server like our own servers.

What Triton cannot take never goes there: chat requests (TensorRT-LLM applies no chat
template), the OpenAI endpoints, and decoding options its ensemble lacks. Triton reports
neither token counts nor why generation ended, so native answers from it carry zero usage and
no ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import ValidationError

from client.backends.base import Backend
from client.backends.chat_templates import preload, render_chat
from client.backends.native_answers_to_openai import CHAT_PATH, COMPLETIONS_PATH, OpenAIShaper
from client.backends.translation import StreamTranslator, Translation
from client.config.schema import TritonServerConfig
from client.gateway_request import ForwardRequest, RequestInfo
from protocol.generation import GenerateRequest
from protocol.health import LoadReport
from protocol.triton import TritonGenerateRequest, TritonGenerateResponse
from utils.errors import APIError
from utils.sse import SSEDataSplitter, encode_done, encode_event

#: The caller endpoints a Triton server answers (through translation).
TRITON_PATHS = ("/generate", COMPLETIONS_PATH, CHAT_PATH)
_ZERO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def triton_unsupported_reasons(request: GenerateRequest) -> tuple[str, ...]:
    """Why a Triton server cannot take the native ``request``, chat aside (empty when it can;
    whether a chat can go depends on the server's entry, see ``TritonBackend.refusal``)."""
    try:
        TritonGenerateRequest.from_generate_request(request, "-", default_max_tokens=1)
    except (ValueError, ValidationError) as exc:
        return (str(exc).splitlines()[0],)
    return ()


@dataclass(eq=False)
class TritonBackend(Backend):
    """One Triton server and the models it serves under Triton names."""

    config: TritonServerConfig = field(kw_only=True)

    @classmethod
    def from_config(cls, config: TritonServerConfig) -> TritonBackend:
        """The backend for one entry of ``triton_server_urls``."""
        return cls(url=config.url, kind="triton", config=config)

    def triton_model(self, model: str | None) -> str:
        """The Triton name of the gateway's ``model`` (no model: the first configured)."""
        if model is None or model not in self.config.models:
            return next(iter(self.config.models.values()))
        return self.config.models[model]

    def refusal(self, info: RequestInfo) -> str | None:
        """Requests with a native equivalent whose decoding Triton can express; chats only
        when the entry names a chat template to render them with."""
        if info.endpoint not in TRITON_PATHS:
            return f"Triton servers do not answer {info.endpoint}"
        if not info.has_native:
            return "Triton servers take one text prompt or one conversation per request"
        if info.is_chat and not self.config.chat_template_from:
            return (
                f"Triton server {self.url} takes text, not messages (set 'chat_template_from' "
                "in its entry to render chats)"
            )
        if info.triton_unsupported:
            return "; ".join(info.triton_unsupported)
        return None

    def translation_for(self, request: ForwardRequest) -> Translation | None:
        """Every request goes through Triton's generate API."""
        if request.native is None:
            raise APIError(500, f"no native request to send to Triton for {request.path}")
        model = request.info.model
        shaper = None
        if request.path != "/generate":  # answer in the OpenAI shape the caller asked for
            name = model or self.triton_model(model)
            shaper = OpenAIShaper(request.path, name, request.info.is_usage_streamed)
        return NativeToTriton(request.native, self.triton_model(model), model, self.config, shaper)

    async def probe(self, client: httpx.AsyncClient, timeout_seconds: float) -> None:
        """Server readiness, then each configured model's; never raises for network trouble."""
        try:
            response = await client.get(self.url_for("/v2/health/ready"), timeout=timeout_seconds)
        except httpx.HTTPError as exc:
            self.record_failed_heartbeat(f"GET /v2/health/ready failed: {type(exc).__name__}")
            return
        if response.status_code != 200:
            self.record_failed_heartbeat(f"GET /v2/health/ready answered {response.status_code}")
            return
        names = list(self.config.models.items())
        ready = await asyncio.gather(
            *(self._is_model_ready(client, triton, timeout_seconds) for _, triton in names)
        )
        model_ids = [ours for (ours, _), is_ready in zip(names, ready, strict=True) if is_ready]
        # A server whose models are still loading answers ready: it is "loading" until one is.
        status = "ok" if model_ids else "loading"
        if model_ids and self.config.chat_template_from and not self.is_healthy:
            await preload(self.config.chat_template_from)  # off the loop, before traffic
        self.record_health(status, model_ids or list(self.config.models), None, LoadReport())

    async def _is_model_ready(
        self, client: httpx.AsyncClient, triton_model: str, timeout_seconds: float
    ) -> bool:
        try:
            path = f"/v2/models/{triton_model}/ready"
            response = await client.get(self.url_for(path), timeout=timeout_seconds)
        except httpx.HTTPError:
            return False
        return response.status_code == 200


def _choices(texts: list[str]) -> list[dict[str, Any]]:
    # Triton does not say why generation ended: finish_reason stays unknown (null).
    return [{"index": i, "text": text, "finish_reason": None} for i, text in enumerate(texts)]


def _native_error(status: int, message: str) -> dict[str, Any]:
    return APIError(status, f"Triton server: {message}").to_response().model_dump()


def _triton_message(body: bytes) -> str:
    """The message of a Triton error body (``{"error": "..."}``), or the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    error = data.get("error") if isinstance(data, dict) else None
    return str(error).strip() if error is not None else str(data)[:500]


class NativeToTriton(Translation):
    """A native prompt request asked of a Triton server's generate extension."""

    def __init__(
        self,
        native: GenerateRequest,
        triton_model: str,
        model: str | None,
        config: TritonServerConfig,
        shaper: OpenAIShaper | None = None,
    ) -> None:
        self.native = native
        self.triton_model = triton_model
        self.model = model or triton_model
        self.config = config
        self.shaper = shaper
        # Triton echoes an id only when the request had one: native answers always carry one.
        self.request_id = f"triton-{uuid.uuid4().hex}"

    def request(self) -> tuple[str, bytes]:
        """``generate`` or ``generate_stream`` with TensorRT-LLM's fields."""
        prompt = self.native.prompt or ""
        if self.native.messages is not None and self.config.chat_template_from:
            prompt = render_chat(self.config.chat_template_from, self.native.messages)
        triton_request = TritonGenerateRequest.from_generate_request(
            self.native, prompt, default_max_tokens=self.config.default_max_tokens
        )
        endpoint = "generate_stream" if self.native.stream else "generate"
        path = f"/v2/models/{self.triton_model}/{endpoint}"
        return path, json.dumps(triton_request.to_triton_json()).encode()

    def answer(self, body: bytes) -> bytes:
        """The native answer: one choice per returned text."""
        data = json.loads(body)
        if "error" in data:  # Triton reports some failures with status 200
            raise APIError(502, f"Triton server: {_triton_message(body)}")
        texts = TritonGenerateResponse.model_validate(data).texts()
        answer = {
            "id": data.get("id") or self.request_id,
            "model": self.model,
            "choices": _choices(texts),
            "usage": _ZERO_USAGE,
        }
        if self.shaper is not None:
            answer = self.shaper.answer(answer)
        return json.dumps(answer).encode()

    def error(self, status: int, body: bytes) -> tuple[int, bytes]:
        """Triton's ``{"error": "..."}`` in the suite's error shape.

        Triton's 404 (it does not know the model name the gateway sent) and 5xx are the
        gateway's or the server's fault, not the caller's: they become 502, which is retried
        on another server and counts against this one's circuit. Its 400s (a request it
        refuses) stay 400.
        """
        if status == 404 or status >= 500:
            status = 502
        return status, json.dumps(_native_error(status, _triton_message(body))).encode()

    def stream(self) -> StreamTranslator:
        """Native events for Triton's stream (which has no end marker of its own)."""
        return TritonStreamTranslator(self.model, self.request_id, self.shaper)


class TritonStreamTranslator(StreamTranslator):
    """Triton ``generate_stream`` events -> native stream chunks, then usage and ``[DONE]``."""

    def __init__(self, model: str, request_id: str, shaper: OpenAIShaper | None = None) -> None:
        self.model = model
        self.request_id = request_id
        self.shaper = shaper
        self._splitter = SSEDataSplitter()
        self._has_failed = False

    def feed(self, data: bytes) -> bytes:
        """A native chunk per Triton event with text; an error event for a Triton error."""
        out: list[bytes] = []
        for payload in self._splitter.feed(data):
            event = json.loads(payload)
            if "error" in event:
                self._has_failed = True
                out.append(encode_event(_native_error(502, _triton_message(payload))))
                continue
            texts = TritonGenerateResponse.model_validate(event).texts()
            choices = [choice for choice in _choices(texts) if choice["text"]]
            if choices:
                chunk = {"id": self.request_id, "model": self.model, "choices": choices}
                out.append(self._encode(chunk))
        return b"".join(out)

    def close(self) -> bytes:
        """Triton's stream just ends: close it the native way (usage chunk, ``[DONE]``)."""
        if self._has_failed:
            return b""
        usage_chunk = {
            "id": self.request_id,
            "model": self.model,
            "choices": [],
            "usage": _ZERO_USAGE,
        }
        return self._encode(usage_chunk) + encode_done()

    def _encode(self, chunk: dict[str, Any]) -> bytes:
        return self.shaper.chunk(chunk) if self.shaper is not None else encode_event(chunk)
