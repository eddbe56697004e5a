"""An OpenAI-API-only facade over one of our servers: the stand-in for a foreign engine.

It proxies ``/v1/*`` (and, when asked, ``/metrics``) to the server behind it, byte for byte and
streams chunk by chunk, and answers nothing else: no native ``/generate``, no ``/health``. A
gateway that treats it as an OpenAI-compatible engine must therefore heart-beat it through
``/v1/models``, translate native requests, and read the load from vLLM's gauges, as it would
for ``vllm serve``. ``required_key`` makes it refuse calls without that bearer key, as
``vllm serve --api-key`` does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from harness.servers import ServerThread

#: Hop-by-hop headers a proxy must not pass on.
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class FacadeSettings:
    """What the facade serves, and what it saw."""

    backend_url: str
    is_serving_metrics: bool = False
    required_key: str | None = None
    #: When given, ``/metrics`` answers this text instead of the server's own.
    metrics_text: str | None = None
    #: Path of every request that reached the facade, in order.
    paths: list[str] = field(default_factory=list)


def build_facade(settings: FacadeSettings) -> FastAPI:
    """The facade app for ``settings``."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    client = httpx.AsyncClient(base_url=settings.backend_url, timeout=120, trust_env=False)

    async def proxy(request: Request, path: str = "") -> Response:
        settings.paths.append(request.url.path)
        is_metrics = request.url.path == "/metrics"
        if is_metrics and not settings.is_serving_metrics:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if is_metrics and settings.metrics_text is not None:
            return Response(settings.metrics_text, media_type="text/plain; version=0.0.4")
        if settings.required_key and not is_metrics:
            if request.headers.get("authorization") != f"Bearer {settings.required_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.pop("authorization", None)  # our server behind needs none
        upstream = client.build_request(
            request.method, request.url.path, content=await request.body(), headers=headers
        )
        response = await client.send(upstream, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)

    app.add_api_route("/v1/{path:path}", proxy, methods=["GET", "POST"])
    app.add_api_route("/metrics", proxy, methods=["GET"], name="metrics")
    return app


def start_facade(settings: FacadeSettings) -> ServerThread:
    """A running facade (real uvicorn on 127.0.0.1)."""
    return ServerThread(build_facade(settings)).start()
