"""Callers for the multi-host tests: a steady concurrent load and what each request saw.

Every request ends in exactly one of: ``ok`` (a full answer), ``error`` (a clean error: an
HTTP error status with the error shape, or a stream that ends with an error event), ``hung``
(no end within the caller's timeout) or ``unclean`` (anything else: a reset connection, a
malformed answer).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["What is the capital of France?", "Name a colour.", "Count to three.", "Say hi."]


@dataclass(frozen=True)
class Outcome:
    """How one request ended."""

    kind: str  # ok | error | hung | unclean
    seconds: float
    detail: str = ""


def _is_error_shape(payload: object) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and {"type", "message", "code"} <= set(error)


async def one_request(
    client: httpx.AsyncClient, base: str, index: int, timeout_seconds: float, max_tokens: int = 8
) -> Outcome:
    """Send request ``index`` (even: streaming chat, odd: completion) and classify its end."""
    start = time.monotonic()
    prompt = PROMPTS[index % len(PROMPTS)]

    async def attempt() -> tuple[str, str]:
        if index % 2 == 0:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
            }
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as answer:
                if answer.status_code != 200:
                    payload = json.loads(await answer.aread() or b"null")
                    kind = "error" if _is_error_shape(payload) else "unclean"
                    return kind, f"HTTP {answer.status_code}"
                is_done = False
                async for line in answer.aiter_lines():
                    if line == "data: [DONE]":
                        is_done = True
                    elif line.startswith("data: ") and _is_error_shape(json.loads(line[6:])):
                        return "error", f"stream error event: {line[:160]}"
                return ("ok", "") if is_done else ("unclean", "stream ended without [DONE]")
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        answer = await client.post(f"{base}/v1/completions", json=body)
        payload = answer.json()
        if answer.status_code == 200:
            return ("ok", "") if payload.get("choices") else ("unclean", "no choices")
        kind = "error" if _is_error_shape(payload) else "unclean"
        return kind, f"HTTP {answer.status_code}"

    try:
        kind, detail = await asyncio.wait_for(attempt(), timeout_seconds)
    except TimeoutError:
        kind, detail = "hung", f"no end within {timeout_seconds} s"
    except (httpx.HTTPError, ValueError) as exc:
        kind, detail = "unclean", f"{type(exc).__name__}: {exc}"
    return Outcome(kind, time.monotonic() - start, detail)


@dataclass
class LoadRun:
    """``concurrency`` callers sending requests back to back from a thread of their own."""

    base: str
    concurrency: int
    timeout_seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> LoadRun:
        """Begin sending."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Counter[str]:
        """Stop sending, wait for the requests in flight to end, and count the outcomes."""
        self._stop.set()
        assert self._thread is not None
        # Each request ends within its own timeout, so this bounds the wait.
        self._thread.join(timeout=self.timeout_seconds + 30)
        assert not self._thread.is_alive(), "the load did not end within its requests' timeout"
        return Counter(outcome.kind for outcome in self.outcomes)

    async def _run(self) -> None:
        # The client's own timeout is longer than the per-request bound: the bound decides.
        timeout = httpx.Timeout(self.timeout_seconds + 5)
        limits = httpx.Limits(max_connections=self.concurrency * 2)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            counter = iter(range(10**9))

            async def caller() -> None:
                while not self._stop.is_set():
                    index = next(counter)
                    outcome = await one_request(client, self.base, index, self.timeout_seconds)
                    self.outcomes.append(outcome)

            await asyncio.gather(*(caller() for _ in range(self.concurrency)))
