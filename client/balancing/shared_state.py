"""Circuit openings shared by gateway replicas through Redis (``shared_state_url``).

Behind a load balancer, each gateway replica would otherwise learn on its own that a jumper
key is rate-limited or that a server fails its requests, and spend requests on it. With a
shared state, a replica that opens a backend's circuit (a key resting after 429, a server
whose requests fail) writes ``until`` (wall-clock) under a key that expires with the rest;
every replica reads all its backends' keys every ``SYNC_INTERVAL_SECONDS`` and keeps traffic
away from those still open. A circuit that closes (a successful trial, a server back from down)
deletes its key. Redis keys name a hash of the backend's identity, never an API key.

Redis is never on a request's path: writes go in background tasks and every call is bounded
by a short timeout. A Redis that is unreachable degrades to local state, with one warning per
outage; requests do not fail because of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from redis import asyncio as redis_asyncio
from redis.exceptions import RedisError

from client.backends.backend import Backend
from utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

SYNC_INTERVAL_SECONDS = 0.5
REDIS_TIMEOUT_SECONDS = 0.5
KEY_PREFIX = "llm-gateway:open:"


def backend_key(backend: Backend) -> str:
    """The Redis key of ``backend``'s opening: a hash of its identity (keys hold no secret)."""
    digest = hashlib.sha256(repr(backend.identity).encode()).hexdigest()[:32]
    return KEY_PREFIX + digest


class SharedBreakerState:
    """Publishes local circuit openings and applies the other replicas' ones."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = redis_asyncio.from_url(
            url, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS
        )
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.is_available = True

    def attach(self, backends: Iterable[Backend]) -> None:
        """Make the breakers of ``backends`` report their openings and closings here."""
        for backend in backends:
            key = backend_key(backend)
            breaker = backend.health.breaker
            breaker.on_open = lambda seconds, key=key: self._spawn(self._publish(key, seconds))
            breaker.on_close = lambda key=key: self._spawn(self._forget(key))

    def start(self, backends_of: Callable[[], list[Backend]]) -> None:
        """Apply the shared openings every sync interval (``backends_of()``: current list)."""
        self._task = asyncio.create_task(self._loop(backends_of), name="shared-state")

    async def stop(self) -> None:
        """End the sync and close the connection."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for pending in list(self._pending):
            pending.cancel()
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test driving a breaker by hand): nothing to share
            coroutine.close()
            return
        task = loop.create_task(coroutine)
        self._pending.add(task)  # a reference, so the task is not collected mid-flight
        task.add_done_callback(self._pending.discard)

    def _went_down(self, exc: BaseException) -> None:
        if self.is_available:
            logger.warning(
                "shared state at %s unreachable (%s: %s); this replica keeps its own state",
                self.url,
                type(exc).__name__,
                exc,
            )
        self.is_available = False

    def _came_back(self) -> None:
        if not self.is_available:
            logger.info("shared state at %s reachable again", self.url)
        self.is_available = True

    async def _publish(self, key: str, seconds: float) -> None:
        until = time.time() + seconds
        try:
            await self._redis.set(key, repr(until), px=max(1, int(seconds * 1000)))
        except (RedisError, OSError) as exc:
            self._went_down(exc)

    async def _forget(self, key: str) -> None:
        try:
            await self._redis.delete(key)
        except (RedisError, OSError) as exc:
            self._went_down(exc)

    async def sync(self, backends: list[Backend]) -> None:
        """Open locally every circuit another replica holds open (one round trip)."""
        if not backends:
            return
        try:
            values = await self._redis.mget([backend_key(backend) for backend in backends])
        except (RedisError, OSError) as exc:
            self._went_down(exc)
            return
        self._came_back()
        now_wall, now = time.time(), time.monotonic()
        for backend, value in zip(backends, values, strict=True):
            if value is not None:
                backend.health.breaker.adopt_opening(now + float(value) - now_wall, now)

    async def _loop(self, backends_of: Callable[[], list[Backend]]) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL_SECONDS)
            try:
                await self.sync(list(backends_of()))
            except Exception:  # one bad round must not end the sync for good
                logger.exception("shared state sync failed")
