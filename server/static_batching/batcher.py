"""The packaging batcher: packs compatible requests that arrive close together into packages.

A package is one call of transformers ``generate``. Rules:

* only requests with the same packing key share a package (the key holds what ``generate``
  applies to the whole batch; per-row settings such as ``max_new_tokens``, ``logit_bias`` and
  the presence and frequency penalties stay out of it for greedy and sampling, which the
  worker handles row by row);
* a package holds at most ``package_max_workload`` beams;
* the package of the oldest waiting request runs next (first come, first served), and that
  request waits at most ``packaging_interval_seconds`` after its arrival for company, so no
  request waits forever and none is dropped;
* a seeded request runs alone, so its output does not depend on what else is queued.

A resumed request (``protocol.resume``) packs like any other of its key: its resumed tokens
end its row's input (left-padded like a longer prompt) and the limits and penalties they count
toward are per row in the worker, so they stay out of the key; beam search is never resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from server.common.backend import SequenceRequest, TextDelta
from server.common.compute_thread import ComputeThread
from server.static_batching.config import SBBatcherConfig
from utils.errors import APIError, overloaded

logger = logging.getLogger(__name__)

PackingKey = tuple[object, ...]
StreamItem = list[TextDelta] | APIError


def packing_key(request: SequenceRequest) -> PackingKey:
    """What must be equal for two requests to share one ``generate`` call."""
    config = request.config
    if config.seed is not None:
        # Unique key: a seeded request is reproducible only when it runs alone.
        return ("seeded", request.request_id)
    if config.is_beam_search:
        # Beam search finishes whole beams, so per-row limits cannot be applied: all in the key.
        return (
            "beam",
            config.num_beams,
            config.num_return_sequences,
            config.length_penalty,
            config.early_stopping,
            config.repetition_penalty,
            config.max_new_tokens,
            config.min_new_tokens,
            tuple(config.stop),
            tuple(config.stop_token_ids),
            config.ignore_eos,
        )
    if config.do_sample:
        return (
            "sample",
            config.temperature,
            config.top_k,
            config.top_p,
            config.typical_p,
            config.min_p,
            config.repetition_penalty,
        )
    # Greedy ignores the sampling knobs, so requests differing only in those still pack together.
    return ("greedy", config.repetition_penalty)


@dataclass(eq=False)
class RequestState:
    """A submitted request and the queue its deltas (or its error) arrive in."""

    request: SequenceRequest
    key: PackingKey
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    submit_time: float = field(default_factory=time.monotonic)
    package_id: int | None = None
    # Set from the event loop, read by the worker thread at every decoding step.
    is_aborted: bool = False
    # Set by the consumer once every choice finished (its package may still be running).
    is_finished: bool = False

    @property
    def num_workload_beams(self) -> int:
        """Beams this request occupies in a package."""
        return self.request.config.num_workload_beams

    @property
    def num_choices(self) -> int:
        """How many sequences the request returns."""
        return self.request.config.num_return_sequences

    def emit(self, item: StreamItem) -> None:
        """Hand deltas or an error to the awaiting coroutine (safe from any thread)."""
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def emit_abort(self) -> None:
        """Finish every choice with ``abort`` (request never ran)."""
        self.emit([TextDelta(i, "", 0, "abort") for i in range(self.num_choices)])


@dataclass
class Package:
    """Requests that run through one ``generate`` call."""

    package_id: int
    key: PackingKey
    states: list[RequestState]

    @property
    def num_workload_beams(self) -> int:
        """Beams of the whole package."""
        return sum(s.num_workload_beams for s in self.states)


@dataclass(frozen=True)
class PackageRecord:
    """What the batcher ran, kept for tests, logs and benchmarks."""

    package_id: int
    request_ids: tuple[str, ...]
    num_workload_beams: int
    key: PackingKey


class PackagingBatcher:
    """Collects requests, packs them and runs each package in one dedicated worker thread.

    ``run_package`` is called in that thread; it must emit every request's deltas or error.
    ``max_prompts_per_package`` caps the prompts of a package (``None``: workload only).
    """

    def __init__(
        self,
        config: SBBatcherConfig,
        run_package: Callable[[Package], None],
        max_prompts_per_package: int | None = None,
        num_records_kept: int = 1000,
        compute: ComputeThread | None = None,
    ) -> None:
        self.config = config
        #: Where packages run: pass the thread that loaded the model (see compute_thread).
        self._compute = compute or ComputeThread("sb-worker")
        self._run_package = run_package
        self._max_prompts = max_prompts_per_package
        self._waiting: list[RequestState] = []
        self._running: Package | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_stopping = False
        self._num_packages = 0
        self.records: deque[PackageRecord] = deque(maxlen=num_records_kept)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a package."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests of the running package that are still generating."""
        if self._running is None:
            return 0
        return sum(1 for s in self._running.states if not (s.is_finished or s.is_aborted))

    @property
    def num_packages(self) -> int:
        """Packages started since start-up."""
        return self._num_packages

    async def start(self) -> None:
        """Start the packaging loop and the worker thread in the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._packaging_loop(), name="sb-packaging")

    async def stop(self, timeout_seconds: float = 30.0) -> None:
        """Stop packing; the running package and waiting requests finish with ``abort``."""
        self._is_stopping = True
        if self._running is not None:
            for state in self._running.states:
                state.is_aborted = True  # the worker ends these rows at its next step
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_seconds)
            except TimeoutError:
                logger.warning("worker did not stop within %.0f s", timeout_seconds)
                self._task.cancel()
        for state in self._waiting:
            state.emit_abort()
        self._waiting.clear()

    def submit(self, request: SequenceRequest) -> RequestState:
        """Queue ``request``; raises ``APIError`` (400 too large, 503 full or stopping)."""
        if self._loop is None:
            raise RuntimeError("the batcher has not been started")
        if self._is_stopping:
            raise overloaded("the server is shutting down", status_code=503)
        config = request.config
        max_workload = self.config.package_max_workload
        if config.num_workload_beams > max_workload:
            param = (
                "num_beams"
                if config.num_beams >= config.num_return_sequences
                else "num_return_sequences"
            )
            raise APIError(
                400,
                f"the request needs {config.num_workload_beams} beams (num_beams="
                f"{config.num_beams}, num_return_sequences={config.num_return_sequences}) but "
                f"this server's package_max_workload is {max_workload}",
                param=param,
            )
        if len(self._waiting) >= self.config.max_queue_size:
            raise overloaded(f"the queue is full ({len(self._waiting)} requests waiting)")
        state = RequestState(request, packing_key(request), self._loop)
        self._waiting.append(state)
        self._wakeup.set()
        return state

    def abort(self, state: RequestState) -> None:
        """The caller is gone: drop a waiting request, or stop a running one at the next step."""
        state.is_aborted = True
        if state in self._waiting:
            self._waiting.remove(state)
            self._wakeup.set()  # the oldest request may have changed

    def _select(self, oldest: RequestState) -> tuple[list[RequestState], bool]:
        """The requests that would go with ``oldest`` now, and whether that package is full."""
        budget = self.config.package_max_workload
        selected: list[RequestState] = []
        num_beams = 0
        for state in self._waiting:
            if state.key != oldest.key or num_beams + state.num_workload_beams > budget:
                continue  # incompatible, or too big for what is left: waits for a later package
            selected.append(state)
            num_beams += state.num_workload_beams
            if num_beams == budget or len(selected) == self._max_prompts:
                return selected, True
        # A seeded request runs alone anyway: waiting for company would only add latency.
        return selected, oldest.key[0] == "seeded"

    async def _wait_for_company(self) -> None:
        """Let the oldest request wait until its package is full or its interval has passed."""
        while self._waiting and not self._is_stopping:
            oldest = self._waiting[0]
            _, is_full = self._select(oldest)
            remaining = oldest.submit_time + self.config.packaging_interval_seconds
            remaining -= time.monotonic()
            if is_full or remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    async def _packaging_loop(self) -> None:
        while not self._is_stopping:
            if not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._wait_for_company()
            if self._is_stopping or not self._waiting:
                continue
            states, _ = self._select(self._waiting[0])
            for state in states:
                self._waiting.remove(state)
            try:
                await self._execute(states)
            except Exception:  # never let one package end the loop: others would wait forever
                logger.exception("packaging loop error")

    async def _execute(self, states: list[RequestState]) -> None:
        self._num_packages += 1
        package = Package(self._num_packages, states[0].key, states)
        for state in states:
            state.package_id = package.package_id
        self.records.append(
            PackageRecord(
                package.package_id,
                tuple(s.request.request_id for s in states),
                package.num_workload_beams,
                package.key,
            )
        )
        logger.debug("package %d: %s", package.package_id, self.records[-1])
        self._running = package
        try:
            await self._compute.run(self._run_package, package)
        except Exception as exc:  # the worker reports its own errors; this is the safety net
            logger.exception("package %d failed outside generate", package.package_id)
            for state in states:
                state.emit(APIError(500, f"generation failed: {type(exc).__name__}: {exc}"))
        finally:
            self._running = None
