"""The gateway's upstream transport (``utils.http_transport``): a connection whose socket
vanished while httpcore opened it is an ``httpx.ConnectError`` (failover retries it), not an
``AttributeError`` that the gateway would answer with a 500."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from harness.network import free_port
from utils.http_transport import ResetSafeTransport


class _VanishedSocketPool:
    """Stands in for httpcore's pool at the moment the race hits: the peer reset the
    connection right after connect, and anyio's socket attributes raise."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def handle_async_request(self, request: object) -> object:
        raise self.exc

    async def __aenter__(self) -> _VanishedSocketPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None


async def _send_through(transport: ResetSafeTransport, url: str) -> None:
    async with httpx.AsyncClient(transport=transport, timeout=5) as client:
        await client.post(url, content=b"{}")


@pytest.mark.parametrize(
    "exc",
    [
        AttributeError("'NoneType' object has no attribute 'getpeername'"),
        OSError(107, "Transport endpoint is not connected"),
    ],
)
def test_a_socket_gone_while_connecting_is_a_connect_error(exc: Exception) -> None:
    transport = ResetSafeTransport()
    transport._pool = _VanishedSocketPool(exc)  # type: ignore[assignment]
    with pytest.raises(httpx.ConnectError, match="broke while it was being opened") as info:
        asyncio.run(_send_through(transport, "http://127.0.0.1:9/v1/completions"))
    assert info.value.__cause__ is exc


def test_a_refused_connection_is_still_httpx_s_own_connect_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1/completions"  # nothing listens there
    with pytest.raises(httpx.ConnectError) as info:
        asyncio.run(_send_through(ResetSafeTransport(), url))
    assert "broke while it was being opened" not in str(info.value)
