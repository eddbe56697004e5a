"""Watching the gateway's config file: changes take effect without a restart.

The file is checked every ``config_watch_interval_seconds`` (its modification time and size,
then its parsed content), and on demand (SIGHUP when the gateway runs on its own). A file that
no longer validates is reported in the log and ignored: the running config stays.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from client.config.loading import load_client_config
from client.config.schema import ClientConfig
from utils.config import ConfigError
from utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class ConfigWatcher:
    """Calls ``on_change`` with the new config whenever the file's content changes."""

    def __init__(
        self,
        path: str | Path,
        current: ClientConfig,
        on_change: Callable[[ClientConfig], Awaitable[None]],
    ) -> None:
        self.path = Path(path)
        self.current = current
        self.on_change = on_change
        self._signature = self._stat()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def _stat(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return (stat.st_mtime_ns, stat.st_size)

    def start(self) -> None:
        """Begin the periodic check (unless the interval is 0)."""
        if self.current.config_watch_interval_seconds > 0:
            self._task = asyncio.create_task(self._loop(), name="config-watch")

    async def stop(self) -> None:
        """End the periodic check."""
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _loop(self) -> None:
        while True:
            # Read each round: a reload may change the interval itself.
            await asyncio.sleep(self.current.config_watch_interval_seconds or 1.0)
            signature = self._stat()
            if signature != self._signature:
                self._signature = signature
                await self.reload()

    async def reload(self) -> bool:
        """Read the file now; returns True when a changed, valid config was applied."""
        async with self._lock:
            try:
                new = load_client_config(self.path)
            except ConfigError as exc:
                logger.error("config reload ignored, the running config stays: %s", exc)
                return False
            if new == self.current:
                return False
            try:
                await self.on_change(new)
            except Exception:
                logger.exception("config reload failed; the running config stays")
                return False
            self.current = new
            logger.info("config reloaded from %s", self.path)
            return True
