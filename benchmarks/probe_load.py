"""Load probes for ``probe_bad_clients.py``: a canary whose answer must not change, an
overload of concurrent requests, streams abandoned mid-way, the leak check after them, and
the "silent wrong answer" of a vanishing temperature."""

from __future__ import annotations

import asyncio

import httpx

from benchmarks.probe_cases import MODEL, Tally


async def complete(http: httpx.AsyncClient, prompt: str, **extra: object) -> tuple[int, str]:
    """A short chat completion through the gateway: (status, text or error)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }
    response = await http.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        return response.status_code, response.text[:200]
    return 200, response.json()["choices"][0]["message"]["content"]


class Canary:
    """A normal greedy request whose answer must not change while the probes run."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.expected: str | None = None

    async def check(self, tally: Tally) -> None:
        """Count a collateral failure when the canary fails or answers differently."""
        try:
            status, text = await complete(self.http, "What is the capital of France?")
        except httpx.HTTPError as exc:
            status, text = 0, type(exc).__name__
        if self.expected is None and status == 200:
            self.expected = text
        if status != 200 or text != self.expected:
            tally.collateral += 1
            tally.failures.append(f"canary: {status} {text[:80]!r}")


async def check_no_leak(server: str, tally: Tally) -> None:
    """The server must be idle with every KV block free shortly after the probe."""
    async with httpx.AsyncClient(base_url=server, timeout=5) as http:
        load: dict = {}
        for _ in range(40):
            load = (await http.get("/health")).json()["load"]
            idle = load["num_running"] == load["num_waiting"] == load["num_swapped"] == 0
            if idle and load["num_kv_blocks_free"] == load["num_kv_blocks_total"]:
                return
            await asyncio.sleep(0.5)  # the engine frees a cancelled request at its next step
    tally.collateral += 1
    tally.failures.append(f"leak: {load}")


async def silent_wrong_answer(http: httpx.AsyncClient, tally: Tally) -> None:
    """``temperature: 1e-300`` must answer what greedy answers (it answered empty text)."""
    greedy = await complete(http, "Name a colour.")
    tiny = await complete(http, "Name a colour.", temperature=1e-300)
    tally.add("temperature 1e-300 equals greedy", tiny[0], tiny == greedy and tiny[0] == 200)


async def overload(http: httpx.AsyncClient, server: str, tally: Tally, num: int) -> None:
    """``num`` requests at once: each is answered 200, or 429/503 with Retry-After."""

    async def one(index: int) -> None:
        body = {"model": MODEL, "prompt": f"Count to {index}:", "max_tokens": 8}
        try:
            response = await http.post("/v1/completions", json=body, timeout=120)
        except httpx.TimeoutException:
            tally.add(f"overload {index}", None, False)
            return
        except httpx.HTTPError as exc:
            tally.add(f"overload {index} {type(exc).__name__}", 0, False)
            return
        status = response.status_code
        refused = status in (429, 503) and "retry-after" in response.headers
        tally.add(f"overload {index}", status, status == 200 or refused)
        if refused:
            tally.notes.append(f"refused {status} with Retry-After")

    await asyncio.gather(*(one(i) for i in range(num)))
    await check_no_leak(server, tally)


async def abandoned_streams(http: httpx.AsyncClient, server: str, tally: Tally, num: int) -> None:
    """``num`` streams at once, 40% dropped after their first event; the rest must end
    with ``[DONE]`` and no error event, and the server must free them all."""

    async def one(index: int) -> None:
        abandon = index % 5 < 2
        body = {
            "model": MODEL,
            "prompt": f"Tell a story about {index}.",
            "max_tokens": 24,
            "stream": True,
        }
        events: list[str] = []
        try:
            async with http.stream("POST", "/v1/completions", json=body, timeout=120) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if abandon:
                            break  # leaving the block closes the connection mid-stream
                status = response.status_code
                refused = status in (429, 503) and "retry-after" in response.headers
        except httpx.HTTPError as exc:
            tally.add(f"stream {index} {type(exc).__name__}", 0, False)
            return
        ok = refused or (
            status == 200
            and (abandon or (events[-1:] == ["[DONE]"] and not any('"error"' in e for e in events)))
        )
        if refused:
            tally.notes.append(f"refused {status} with Retry-After (queue full)")
        tally.add(f"stream {index}{' (abandoned)' if abandon else ''}", status, ok)

    await asyncio.gather(*(one(i) for i in range(num)))
    await check_no_leak(server, tally)
