"""The one thread of a server process that runs the model: loading, warm-up and every step.

PyTorch's CPU kernels parallelise with OpenMP, and every thread that enters a parallel region
gets an OpenMP team of its own. A server that loads its model on the main thread and runs it
on a worker thread therefore holds two teams: more OpenMP threads than cores. libgomp then
throttles the busy-waiting its threads do between parallel regions, for every team, and each
of the thousands of small regions of a decoding step pays a wake-up. Measured on the 2-core
machine (SmolLM2-135M, bfloat16, a decode step of 32 sequences): about 36 ms with one team,
55-70 ms with two, whichever thread runs the step. Doing all model work in one thread keeps
one team; the event loop's thread never touches torch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Future[Any]]


class ComputeThread:
    """One daemon thread that runs, in order, every job that touches the model.

    A daemon thread (unlike ``ThreadPoolExecutor``'s) never holds the process at exit: an
    engine loop left running by a crashed start-up must not hang the worker's shutdown.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:  # for the life of the process (a daemon thread)
            fn, args, kwargs, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Queue ``fn`` on the compute thread."""
        future: Future[T] = Future()
        self._jobs.put((fn, args, kwargs, future))
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in the compute thread and wait for its result (start-up only: this
        blocks the calling thread)."""
        return self.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` in the compute thread from async code, without blocking the loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))
