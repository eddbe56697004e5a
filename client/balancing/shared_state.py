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
outage; requests do not fail because of it. When it is reachable again (the same Redis, or one
restarted empty), the replica writes again the openings of its own that are still running, so
that what it learnt alone reaches the others; a write never shortens a longer opening another
replica stored. Closings made during an outage are not replayed: deleting then could erase a
newer opening of another replica, and a stale key expires with its opening anyway. The log
names Redis without its password.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from client.backends.backend import Backend
from utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

SYNC_INTERVAL_SECONDS = 0.5
REDIS_TIMEOUT_SECONDS = 0.5
KEY_PREFIX = "llm-gateway:open:"


#: Store an opening unless the key holds a later one: KEYS[1], ARGV[1] wall-clock ``until``,
#: ARGV[2] its expiry in ms. Atomic in Redis, so two replicas writing at once keep the longer.
_PUBLISH_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current and tonumber(current) and tonumber(current) >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


def redacted_url(url: str) -> str:
    """``url`` fit for a log: its password (``redis://:secret@host``) masked."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 address keeps its brackets
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def backend_key(backend: Backend) -> str:
    """The Redis key of ``backend``'s opening: a hash of its identity (keys hold no secret)."""
    digest = hashlib.sha256(repr(backend.identity).encode()).hexdigest()[:32]
    return KEY_PREFIX + digest


class SharedBreakerState:
    """Publishes local circuit openings and applies the other replicas' ones."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = redis_asyncio.from_url(
            url,
            socket_timeout=REDIS_TIMEOUT_SECONDS,
            socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
            # A pooled connection that died while idle (Redis restarted, a proxy or NAT
            # dropped it) fails its next call at once: one immediate retry on a fresh
            # connection, or every reconnection would log a spurious outage. Timeouts are not
            # retried, so a silent Redis still costs one timeout per call.
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._publish_script = self._redis.register_script(_PUBLISH_SCRIPT)
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        #: This replica's own openings still running: Redis key -> wall-clock until. Written
        #: again when Redis comes back, since the outage may have lost them (a write that
        #: failed, or a Redis restarted empty).
        self._own_openings: dict[str, float] = {}
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
        if self.is_available:  # once per outage: not once per failed call (2 a second)
            logger.warning(
                "shared state at %s unreachable (%s: %s); this replica keeps its own state",
                redacted_url(self.url),
                type(exc).__name__,
                exc,
            )
        self.is_available = False

    def _came_back(self) -> None:
        if self.is_available:
            return
        self.is_available = True
        logger.info("shared state at %s reachable again", redacted_url(self.url))
        # What this replica opened during the outage never reached Redis, and a restarted
        # Redis lost the rest: write every opening of ours still running again.
        now_wall = time.time()
        for key, until in list(self._own_openings.items()):
            if until > now_wall:
                self._spawn(self._write_opening(key, until))
            else:
                self._own_openings.pop(key, None)

    async def _publish(self, key: str, seconds: float) -> None:
        until = time.time() + seconds
        self._own_openings[key] = until
        await self._write_opening(key, until)

    async def _write_opening(self, key: str, until: float) -> None:
        milliseconds = int((until - time.time()) * 1000)
        if milliseconds <= 0:
            return
        try:
            await self._publish_script(keys=[key], args=[repr(until), milliseconds])
        except (RedisError, OSError) as exc:
            self._went_down(exc)
            return
        self._came_back()

    async def _forget(self, key: str) -> None:
        self._own_openings.pop(key, None)
        try:
            await self._redis.delete(key)
        except (RedisError, OSError) as exc:
            self._went_down(exc)
            return
        self._came_back()

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
                # adopt_opening takes the seconds left (stored: the wall-clock end), not a
                # monotonic deadline: passing one kept adopted openings open for hours.
                backend.health.breaker.adopt_opening(float(value) - now_wall, now)

    async def _loop(self, backends_of: Callable[[], list[Backend]]) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL_SECONDS)
            try:
                await self.sync(list(backends_of()))
            except Exception:  # one bad round must not end the sync for good
                logger.exception("shared state sync failed")
