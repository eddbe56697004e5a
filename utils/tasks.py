"""Small helpers for the asyncio tasks a service keeps in the background."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has ended; ``None`` (never started) is a no-op.

    The task's own ``CancelledError`` is swallowed: the caller asked for it. Waiting matters
    because a cancelled task still runs its ``finally`` blocks; a ``stop()`` that returned
    before them would let the caller close what those blocks still use. Callers clear their
    reference first (``task, self._task = self._task, None``) so a second ``stop()`` is a no-op.
    """
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
