"""``utils.tasks.cancel_and_wait``: the cancel-and-await every background loop's ``stop()`` uses."""

from __future__ import annotations

import asyncio

from utils.tasks import cancel_and_wait


async def test_cancels_and_waits_for_the_finally_block() -> None:
    cleaned = asyncio.Event()

    async def loop() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)  # the cleanup itself awaits: stop must wait past it
            cleaned.set()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # let it reach its sleep
    await cancel_and_wait(task)
    assert task.cancelled()
    assert cleaned.is_set()


async def test_none_and_finished_tasks_are_no_ops() -> None:
    await cancel_and_wait(None)

    async def done() -> int:
        return 1

    task = asyncio.create_task(done())
    await task
    await cancel_and_wait(task)
    assert task.result() == 1
