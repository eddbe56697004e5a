"""All backends of the gateway, their periodic health refresh, and candidate lookup by model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection

import httpx

from client.backends import Backend, BackendKind
from client.config import ClientConfig

logger = logging.getLogger(__name__)

#: A request that finds no candidate triggers a refresh, but at most this often: a burst of
#: requests for a dead server then costs one round of health checks, not one per request.
LAZY_REFRESH_MIN_INTERVAL_SECONDS = 0.25


class BackendRegistry:
    """Holds every configured backend and keeps their health and load up to date.

    Life cycle: :meth:`start` (first refresh, then a background refresh every heartbeat
    interval) and :meth:`stop`. A server that is down at start-up does not stop the gateway:
    it is marked unhealthy and found by a later refresh.
    """

    def __init__(
        self,
        backends: list[Backend],
        *,
        health_timeout_seconds: float = 3.0,
        heartbeat_interval_seconds: float = 10.0,
        lazy_refresh_min_interval_seconds: float = LAZY_REFRESH_MIN_INTERVAL_SECONDS,
    ) -> None:
        self.backends = backends
        self.health_timeout_seconds = health_timeout_seconds
        self.heartbeat_interval_seconds = heartbeat_interval_seconds
        self.lazy_refresh_min_interval_seconds = lazy_refresh_min_interval_seconds
        self._client: httpx.AsyncClient | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._refresh_lock = asyncio.Lock()
        self._last_refresh_at: float | None = None

    @classmethod
    def from_config(cls, config: ClientConfig) -> BackendRegistry:
        """One backend per configured server URL (CB servers first)."""
        urls: list[tuple[str, BackendKind]] = [
            (url, "continuous_batching") for url in config.continuous_batching_server_urls
        ]
        urls += [(url, "static_batching") for url in config.static_batching_server_urls]
        return cls(
            [Backend(url=url, kind=kind) for url, kind in urls],
            health_timeout_seconds=config.health_timeout_seconds,
            heartbeat_interval_seconds=config.heart_beat_interval_seconds,
        )

    # -- life cycle ------------------------------------------------------------------------

    async def start(self, client: httpx.AsyncClient) -> None:
        """Check every backend once, then keep checking in the background."""
        self._client = client
        await self.refresh()
        healthy = self.healthy()
        if self.backends and not healthy:
            logger.warning(
                "no backend is healthy yet (%d configured); checking again every %.1f s",
                len(self.backends),
                self.heartbeat_interval_seconds,
            )
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def stop(self) -> None:
        """Cancel the background refresh and wait for it to end."""
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_seconds)
            try:
                await self.refresh()
            except Exception:  # a bug in one round must not end the heartbeat for good
                logger.exception("health refresh failed")

    # -- refresh ---------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Ask every backend for its health concurrently (each bounded by the health timeout)."""
        async with self._refresh_lock:
            await self._refresh_locked()

    async def refresh_if_stale(self) -> None:
        """Refresh unless one finished very recently; concurrent callers share one refresh."""
        async with self._refresh_lock:
            last = self._last_refresh_at
            if last is None or time.monotonic() - last >= self.lazy_refresh_min_interval_seconds:
                await self._refresh_locked()

    async def _refresh_locked(self) -> None:
        if self._client is None:
            raise RuntimeError("BackendRegistry.start() has not been called")
        client, timeout = self._client, self.health_timeout_seconds
        await asyncio.gather(*(backend.probe(client, timeout) for backend in self.backends))
        self._last_refresh_at = time.monotonic()

    # -- lookup ----------------------------------------------------------------------------

    def get(self, url: str) -> Backend | None:
        """The backend with this URL, if configured."""
        return next((backend for backend in self.backends if backend.url == url), None)

    def healthy(self) -> list[Backend]:
        """Backends that take requests now."""
        return [backend for backend in self.backends if backend.is_healthy]

    def candidates(self, model: str | None, exclude: Collection[Backend] = ()) -> list[Backend]:
        """Healthy backends that can serve ``model`` (any model when ``None``), best kind only.

        Continuous-batching servers are preferred over static-batching ones when both serve the
        model; ``exclude`` drops backends already tried for this request (for failover).
        """
        eligible = [
            backend
            for backend in self.healthy()
            if backend not in exclude and (model is None or backend.serves(model))
        ]
        if not eligible:
            return []
        best = min(backend.priority for backend in eligible)
        return [backend for backend in eligible if backend.priority == best]

    def model_ids(self, *, is_healthy_only: bool = True) -> list[str]:
        """Model ids served by the (healthy) backends, each once, in configuration order."""
        backends = self.healthy() if is_healthy_only else self.backends
        seen: dict[str, None] = {}
        for backend in backends:
            seen.update(dict.fromkeys(backend.model_ids))
        return list(seen)

    def max_model_len(self, model: str) -> int | None:
        """The context length a healthy server reports for ``model`` (the smallest if several)."""
        lengths = [
            backend.max_model_len
            for backend in self.healthy()
            if backend.serves(model) and backend.max_model_len is not None
        ]
        return min(lengths) if lengths else None
