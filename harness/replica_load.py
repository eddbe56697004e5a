"""The load of the chaos scenarios, sent the way a load balancer in front of the gateway
replicas would: a request that got no byte from a replica is sent to the next one.

Every answer is checked against the echo servers' (``harness.fake_server``, echo mode): the
prompt's words reversed, so a wrong or truncated answer is counted, not passed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.fake_server import echo_text

#: A request that takes longer counts as hung.
REQUEST_TIMEOUT_SECONDS = 20.0
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


@dataclass
class LoadReport:
    """What the load's callers saw."""

    num_sent: int = 0
    num_ok: int = 0
    #: Answers that came back whole but with text other than the request's own.
    num_wrong: int = 0
    #: Requests that got no byte from any replica (refused or closed everywhere), or an error
    #: status: requests lost that had not started. Goal: 0.
    num_lost_not_started: int = 0
    #: Requests whose answer had begun (status line received) when their replica died: lost
    #: in flight, the client saw a partial answer.
    num_lost_in_flight: int = 0
    #: Requests a replica refused (connection refused): sent to the other one.
    num_retried_refused: int = 0
    #: Requests sent to a replica that closed without a byte: sent to the other one.
    num_retried_no_byte: int = 0
    #: Requests that took longer than REQUEST_TIMEOUT_SECONDS.
    num_hung: int = 0
    max_latency_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class ReplicaClient:
    """Sends the load over the replicas, the way a load balancer in front of them would.

    Requests ``4k .. 4k+3`` prefer replica ``k % n``; a replica that gives no byte (connection
    refused, or closed before the status line) gets the request again on the next replica. Once the
    status line has come, the request belongs to that replica: if it dies, the request is lost
    in flight (a non-idempotent POST that started is not replayed).
    """

    def __init__(self, urls: list[str], report: LoadReport) -> None:
        self.urls = urls
        self.report = report
        self.http = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS, trust_env=False)
        #: Requests in flight per replica URL (the kill is timed by them).
        self.in_flight = dict.fromkeys(urls, 0)

    async def aclose(self) -> None:
        """Close the connections."""
        await self.http.aclose()

    @staticmethod
    def request_of(index: int) -> tuple[str, dict[str, Any], str]:
        """Request ``index``: (path, body, expected text); four kinds in turn."""
        words = [f"r{index}"] + [WORDS[(index + k) % len(WORDS)] for k in range(5)]
        prompt = " ".join(words)
        is_chat, is_stream = index % 4 >= 2, index % 2 == 1
        body: dict[str, Any] = {"model": "m", "max_tokens": 16, "stream": is_stream}
        if is_chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            path = "/v1/completions"
        return path, body, echo_text(prompt)

    async def send(self, index: int) -> None:
        """Send request ``index`` and count what happened to it."""
        path, body, expected = self.request_of(index)
        report = self.report
        report.num_sent += 1
        start = time.monotonic()
        # Four requests in a row (the four kinds) per replica, so each replica gets every kind.
        first = index // 4
        order = [self.urls[(first + k) % len(self.urls)] for k in range(len(self.urls))]
        try:
            outcome = await asyncio.wait_for(
                self._send(order, path, body, expected), REQUEST_TIMEOUT_SECONDS
            )
        except TimeoutError:
            outcome = "hung"
        report.max_latency_seconds = max(report.max_latency_seconds, time.monotonic() - start)
        if outcome == "ok":
            report.num_ok += 1
        elif outcome == "wrong":
            report.num_wrong += 1
        elif outcome == "in_flight":
            report.num_lost_in_flight += 1
        elif outcome == "hung":
            report.num_hung += 1
        else:
            report.num_lost_not_started += 1
            if len(report.errors) < 10:
                report.errors.append(f"request {index}: {outcome}")

    async def _send(self, order: list[str], path: str, body: dict[str, Any], expected: str) -> str:
        last_error = "no replica"
        for attempt, url in enumerate(order):
            self.in_flight[url] += 1
            try:
                async with self.http.stream("POST", url + path, json=body) as response:
                    # The status line came: from here on the request is this replica's.
                    try:
                        if response.status_code != 200:
                            await response.aread()
                            return f"HTTP {response.status_code}: {response.text[:200]}"
                        text = await self._read_text(response, bool(body["stream"]), path)
                    except (httpx.HTTPError, ValueError, KeyError):
                        return "in_flight"
                    return "ok" if text == expected else "wrong"
            except httpx.ConnectError as exc:
                last_error = f"refused: {exc}"
                if attempt + 1 < len(order):
                    self.report.num_retried_refused += 1
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                last_error = f"no byte: {type(exc).__name__}: {exc}"
                if attempt + 1 < len(order):
                    self.report.num_retried_no_byte += 1
            finally:
                self.in_flight[url] -= 1
        return last_error

    @staticmethod
    async def _read_text(response: httpx.Response, is_stream: bool, path: str) -> str | None:
        """The answer's text; None for an answer that is not whole (no [DONE], error event)."""
        is_chat = path == "/v1/chat/completions"
        if not is_stream:
            choice = json.loads(await response.aread())["choices"][0]
            return choice["message"]["content"] if is_chat else choice["text"]
        pieces, is_done = [], False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                is_done = True
                continue
            event = json.loads(data)
            if "error" in event:
                return None
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") if is_chat else choice["text"]
                pieces.append(piece or "")
        return "".join(pieces) if is_done else None


async def run_load(
    client: ReplicaClient,
    concurrency: int,
    num_requests: int | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Send ``num_requests`` requests (or until ``stop`` is set), ``concurrency`` at a time."""
    counter = itertools.count()

    async def worker() -> None:
        while True:
            if stop is not None and stop.is_set():
                return
            index = next(counter)
            if num_requests is not None and index >= num_requests:
                return
            await client.send(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
