"""Batches the inputs of requests that arrive together into forward passes of the encoder.

Every input waits in one queue. When the first one arrives the batcher waits
``batching_interval_seconds`` for company, then takes everything waiting, sorts it by length
(similar lengths pad little) and cuts it into batches of at most ``max_batch_tokens`` padded
tokens. The forward passes run one at a time on the server's compute thread, so the event loop
keeps answering (health checks included) while the model works.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from server.common.compute_thread import ComputeThread
from server.embedding.config import EmbeddingBatcherConfig
from server.embedding.encoder import Encoder
from utils.errors import overloaded
from utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


@dataclass
class _Item:
    token_ids: list[int]
    future: asyncio.Future[torch.Tensor]


class EmbeddingBatcher:
    """The queue of inputs and the task that turns it into forward passes."""

    def __init__(self, encoder: Encoder, config: EmbeddingBatcherConfig) -> None:
        self.encoder = encoder
        self.config = config
        self.compute = ComputeThread("embedding-compute")
        self._queue: list[_Item] = []
        self._has_work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Inputs in the forward pass running now (for the load report).
        self.num_running = 0
        self.num_batches = 0
        self.num_inputs = 0

    @property
    def num_waiting(self) -> int:
        """Inputs queued for a later forward pass."""
        return len(self._queue)

    def start(self) -> None:
        """Start the batching task (inside the event loop)."""
        self._task = asyncio.create_task(self._run(), name="embedding-batcher")

    async def stop(self) -> None:
        """Stop batching; inputs still waiting fail (their callers get an error)."""
        task, self._task = self._task, None
        await cancel_and_wait(task)
        for item in self._queue:
            if not item.future.done():
                item.future.set_exception(overloaded("the server is shutting down"))
        self._queue.clear()

    def submit(self, inputs: list[list[int]]) -> list[asyncio.Future[torch.Tensor]]:
        """Queue ``inputs`` (ids with special tokens); one future per vector. All or none:
        503 when the queue has no room for every one of them."""
        if len(self._queue) + len(inputs) > self.config.max_queue_size:
            raise overloaded(
                f"the embedding queue is full ({len(self._queue)} inputs waiting); retry later"
            )
        loop = asyncio.get_running_loop()
        items = [_Item(ids, loop.create_future()) for ids in inputs]
        self._queue.extend(items)
        self._has_work.set()
        return [item.future for item in items]

    def _batches(self, items: list[_Item]) -> list[list[_Item]]:
        """``items`` by length, cut where the padded size would pass ``max_batch_tokens``."""
        batches: list[list[_Item]] = []
        current: list[_Item] = []
        for item in sorted(items, key=lambda it: len(it.token_ids)):
            longest = len(item.token_ids)  # sorted: the newest item is the longest
            if current and (len(current) + 1) * longest > self.config.max_batch_tokens:
                batches.append(current)
                current = []
            current.append(item)
        if current:
            batches.append(current)
        return batches

    async def _run(self) -> None:
        while True:
            await self._has_work.wait()
            await asyncio.sleep(self.config.batching_interval_seconds)
            items, self._queue = self._queue, []
            self._has_work.clear()
            for batch in self._batches([it for it in items if not it.future.done()]):
                await self._forward(batch)

    async def _forward(self, batch: list[_Item]) -> None:
        self.num_running = len(batch)
        try:
            vectors = await self.compute.run(self.encoder.encode, [it.token_ids for it in batch])
        except Exception as exc:  # the batch's callers get the error; the batcher goes on
            logger.exception("embedding forward pass failed for %d inputs", len(batch))
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self.num_running = 0
        self.num_batches += 1
        self.num_inputs += len(batch)
        for row, item in enumerate(batch):
            if not item.future.done():  # a caller that left has cancelled its future
                item.future.set_result(vectors[row])
