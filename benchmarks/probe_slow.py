"""Slow and idle clients for ``probe_bad_clients.py``: connections that say nothing, headers
and bodies trickled a byte a second. Each counts as correct when the server closes it within
the hold time, as a hang when it is still open at the end; normal requests run meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

#: What a slow client of each kind sends before trickling (the key: a guarded route would
#: answer 401 before reading any body, which is no test of the body timeout).
_OPENINGS = {
    "idle": b"",
    "headers": b"GET /health HTTP/1.1\r\nHost: probe\r\n",
    "body": b"POST /generate HTTP/1.1\r\nHost: probe\r\nContent-Type: application/json\r\n"
    b"Authorization: Bearer {key}\r\nContent-Length: 100000\r\n\r\n",
}
_TRICKLE = {"idle": b"", "headers": b"X", "body": b" "}


async def _slow_client(url: str, kind: str, key: str, hold_seconds: float) -> float | None:
    """Be slow in the way of ``kind``; the seconds until the server closed the connection,
    or None if it was still open after ``hold_seconds``."""
    loop = asyncio.get_running_loop()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    started = loop.time()
    writer.write(_OPENINGS[kind].replace(b"{key}", key.encode()))
    answered = False
    try:
        while (left := started + hold_seconds - loop.time()) > 0:
            if not answered and _TRICKLE[kind]:
                writer.write(_TRICKLE[kind])  # a byte a second
            try:
                data = await asyncio.wait_for(reader.read(65536), min(1.0, left))
            except TimeoutError:
                continue
            if not data:
                return loop.time() - started  # closed by the server
            answered = True  # the server answered (408): wait for its close
        return None
    except ConnectionError:
        return loop.time() - started
    finally:
        writer.close()


async def hold_slow_clients(
    urls: dict[str, str],
    key: str,
    tally: Any,
    served: Callable[[], Awaitable[tuple[bool, float]]],
    *,
    hold_seconds: float,
    num_idle: int,
    num_slow: int,
) -> None:
    """``num_idle`` idle connections and ``num_slow`` byte-a-second header and body clients
    on each of ``urls``, held up to ``hold_seconds``, while ``served`` (a normal request)
    runs every two seconds: one that fails or takes over 5 s is a collateral failure."""
    clients = []
    for target, url in urls.items():
        kinds = ["idle"] * num_idle + ["headers"] * num_slow + ["body"] * num_slow
        clients += [
            (f"{target} {kind}", _slow_client(url, kind, key, hold_seconds)) for kind in kinds
        ]
    held = asyncio.gather(*(coro for _, coro in clients))
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not held.done():
        ok, seconds = await served()
        if not ok or seconds > 5:
            tally.collateral += 1
            tally.failures.append(f"normal request during slow clients: ok={ok} {seconds:.1f} s")
        await asyncio.wait([held], timeout=max(0.0, 2.0 - (loop.time() - started) % 2.0))
    closed: dict[str, list[float]] = {}
    for (name, _), closed_after in zip(clients, held.result(), strict=True):
        if closed_after is None:
            tally.add(f"{name} still open after {hold_seconds:g} s", None, False)
        else:
            tally.add(name, 200, True)
            closed.setdefault(name, []).append(closed_after)
    for name, seconds in closed.items():
        tally.notes.append(f"{name}: closed after {min(seconds):.1f}-{max(seconds):.1f} s")
