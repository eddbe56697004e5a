"""Server-Sent Events: encode events on the way out, parse them on the way in."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

DONE = "[DONE]"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_MEDIA_TYPE = "text/event-stream"


def encode_event(payload: BaseModel | dict[str, Any] | str) -> bytes:
    """One ``data:`` event; models and dicts are sent as compact JSON."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude_none=False)
    elif isinstance(payload, dict):
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    else:
        data = payload
    return f"data: {data}\n\n".encode()


def encode_done() -> bytes:
    """The closing ``[DONE]`` event."""
    return encode_event(DONE)


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the ``data`` field of each event from a stream of text lines."""
    data_lines: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data_lines:
                yield "\n".join(data_lines)
                data_lines = []
            continue
        if line.startswith(":"):
            continue
        if line.startswith("data:"):
            data_lines.append(line[5:].removeprefix(" "))
    if data_lines:
        yield "\n".join(data_lines)
