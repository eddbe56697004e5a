"""The async front of the engine: one engine loop in the compute thread (the thread that loaded
the model, see ``server.common.compute_thread``), results handed to the awaiting coroutines
through ``loop.call_soon_threadsafe`` (no polling anywhere): one call per engine step carries
the outputs of every request of that step, so the event loop is woken (one self-pipe write and
one loop iteration) once per step, however many requests are streaming.

It implements ``GenerationBackend``, so the shared HTTP layer serves it like any backend.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

from protocol import errors as error_types
from protocol.health import LoadReport, ServerKind
from server.common.backend import GenerationBackend, SequenceRequest, TextDelta
from server.common.compute_thread import ComputeThread
from server.continuous_batching.decoding.decoder import RequestOutput
from server.continuous_batching.engine import EngineError, LLMEngine
from utils.errors import APIError, overloaded

logger = logging.getLogger(__name__)


class AsyncEngine(GenerationBackend):
    """Drives an ``LLMEngine`` from a dedicated thread for asyncio callers."""

    kind: ServerKind = "continuous_batching"
    is_structured_output_supported = True
    is_logprobs_supported = True
    is_priority_supported = True

    def __init__(
        self, engine: LLMEngine, model_id: str, compute: ComputeThread | None = None
    ) -> None:
        self.engine = engine
        #: Where the engine loop runs: pass the thread that built the engine.
        self.compute = compute or ComputeThread("engine")
        self.model_id = model_id
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.compute_path = engine.runner.compute_path
        self._commands: list[tuple[str, Any]] = []
        self._wakeup = threading.Condition()
        self._streams: dict[str, asyncio.Queue[RequestOutput | APIError]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_future: Future[None] | None = None
        self._is_stopping = False

    async def start(self) -> None:
        """Start the engine loop in the compute thread (inside the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._is_stopping = False
        self._loop_future = self.compute.submit(self._run)

    async def shutdown(self) -> None:
        """Stop the thread; requests still in flight end with finish_reason "abort"."""
        with self._wakeup:
            self._is_stopping = True
            self._wakeup.notify()
        if self._loop_future is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(self._loop_future), 30)
            except TimeoutError:
                logger.warning("the engine loop did not stop within 30 s")
        aborted = [(request_id, self.engine.abort(request_id)) for request_id in self._streams]
        self._distribute([(request_id, out) for request_id, out in aborted if out is not None])

    def _submit(self, command: str, payload: Any) -> None:
        with self._wakeup:
            self._commands.append((command, payload))
            self._wakeup.notify()

    async def stream(self, request: SequenceRequest) -> AsyncIterator[list[TextDelta]]:
        """Yield delta batches until the request finishes; closing early aborts it."""
        if self._is_stopping or self._loop is None:
            raise overloaded("the engine is not running", retry_after_seconds=5)
        queue: asyncio.Queue[RequestOutput | APIError] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._submit("add", request)
        is_finished = False
        try:
            while not is_finished:
                item = await queue.get()
                if isinstance(item, APIError):
                    is_finished = True
                    raise item
                is_finished = item.is_finished
                yield item.deltas
        finally:
            self._streams.pop(request.request_id, None)
            if not is_finished:
                self._submit("abort", request.request_id)

    def load_report(self) -> LoadReport:
        """Queue and cache figures, read from the engine without locking (a snapshot)."""
        scheduler = self.engine.scheduler
        block_manager = self.engine.block_manager
        return LoadReport(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped),
            num_kv_blocks_free=block_manager.device.num_free,
            num_kv_blocks_total=block_manager.device.num_blocks,
            num_cpu_kv_blocks_free=block_manager.cpu.num_free,
            num_cpu_kv_blocks_total=block_manager.cpu.num_blocks,
        )

    def counters(self) -> dict[str, float]:
        """Engine steps, generated tokens, preemptions by kind and prefix-cache hits."""
        stats = self.engine.stats
        return {
            "engine_steps": stats.num_steps,
            "preemptions_swap": stats.num_swap_preemptions,
            "preemptions_recompute": stats.num_recompute_preemptions,
            "prefix_cache_hit_tokens": self.engine.block_manager.num_prefix_hit_tokens,
        }

    def _distribute(self, items: list[tuple[str, RequestOutput | APIError]]) -> None:
        """Event-loop side of the hand-off: every output of one step to its stream's queue."""
        for request_id, item in items:
            queue = self._streams.get(request_id)
            if queue is not None:  # None: the caller went away, its abort is on its way
                queue.put_nowait(item)

    # -- engine thread --------------------------------------------------------------------
    def _hand_off(self, items: list[tuple[str, RequestOutput | APIError]]) -> None:
        """Give one step's outputs to the event loop with a single wake-up."""
        if items and self._loop is not None:
            self._loop.call_soon_threadsafe(self._distribute, items)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wakeup:
                while not (self._commands or engine.has_unfinished_requests() or self._is_stopping):
                    self._wakeup.wait()
                if self._is_stopping:
                    return
                commands, self._commands = self._commands, []
            # Refusals of this round's commands travel with the step's outputs.
            items: list[tuple[str, RequestOutput | APIError]] = []
            for command, payload in commands:
                refusal = self._apply(command, payload)
                if refusal is not None:
                    items.append(refusal)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as exc:  # a bug or device error: fail what is in flight
                    logger.exception("engine step failed")
                    items.extend(
                        self._fail_all(APIError(500, f"generation failed: {type(exc).__name__}"))
                    )
                    outputs = []
                items.extend((output.request_id, _failure(output) or output) for output in outputs)
            self._hand_off(items)

    def _apply(self, command: str, payload: Any) -> tuple[str, APIError] | None:
        """Run one command; a refused request comes back with its error."""
        if command == "abort":
            self.engine.abort(payload)
            return None
        request: SequenceRequest = payload
        try:
            self.engine.add_request(request)
        except EngineError as exc:
            if exc.status_code == 503:
                error = overloaded(exc.message, retry_after_seconds=1)
            else:
                error = APIError(exc.status_code, exc.message)
            return request.request_id, error
        return None

    def _fail_all(self, error: APIError) -> list[tuple[str, APIError]]:
        failed = list(self.engine.groups)
        for request_id in failed:
            self.engine.abort(request_id)
        return [(request_id, error) for request_id in failed]


def _failure(output: RequestOutput) -> APIError | None:
    """The error for a request that failed alone in the engine step (None: it did not)."""
    if output.error is None:
        return None
    return APIError(
        500,
        f"generation failed for this request ({output.error}); other requests are unaffected",
        error_type=error_types.REQUEST_FAILED,
    )
