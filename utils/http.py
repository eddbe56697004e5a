"""HTTP helpers shared by the apps: disconnect detection and SSE responses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from utils.errors import APIError
from utils.sse import SSE_HEADERS, SSE_MEDIA_TYPE, encode_done, encode_event

T = TypeVar("T")
logger = logging.getLogger(__name__)


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body is read, the next ASGI message is http.disconnect: no polling needed.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (freeing what it holds).

    Raises ``APIError(499)`` when the client disconnected (nobody reads the answer).
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        with contextlib.suppress(BaseException):
            await watch_task
    if not work_task.done():
        work_task.cancel()
        with contextlib.suppress(BaseException):
            await work_task
        raise APIError(499, "client disconnected")
    return work_task.result()


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) anything over ``max_bytes`` without reading it all."""
    too_large = APIError(413, f"the request body is larger than the limit of {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(declared) > max_bytes:
            raise too_large
    chunks: list[bytes] = []
    num_bytes = 0
    async for chunk in request.stream():  # also covers chunked bodies without Content-Length
        num_bytes += len(chunk)
        if num_bytes > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def sse_response(events: AsyncIterator[bytes]) -> StreamingResponse:
    """Stream encoded SSE events, closing with ``[DONE]``.

    An ``APIError`` raised mid-stream becomes an error event (the status line is gone
    already), so the caller always learns why the stream ended.
    """

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except APIError as exc:
            yield encode_event(exc.to_response())
        except Exception as exc:
            logger.exception("stream failed")
            yield encode_event(APIError(500, f"internal error: {type(exc).__name__}").to_response())
        yield encode_done()

    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)


async def prime(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """Await the first item before the response starts, so early refusals keep their status.

    A request refused before it produced anything (overload, timeout in the queue) then
    answers with a real 4xx/5xx status instead of a 200 stream holding an error event.
    """
    iterator = items.__aiter__()
    try:
        first: list[T] = [await iterator.__anext__()]
    except StopAsyncIteration:
        first = []
    except BaseException:
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()
        raise

    async def chained() -> AsyncIterator[T]:
        try:
            for item in first:
                yield item
            async for item in iterator:
                yield item
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()

    return chained()
