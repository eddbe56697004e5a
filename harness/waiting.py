"""Waiting for a condition with a deadline, and reading Prometheus metrics: the one polling
loop of the tests and benchmarks.

``wait_until(condition, timeout)`` calls ``condition()`` every ``interval`` seconds until it
gives a truthy value, and returns that value. With ``until``, ``condition()`` is an observation
(a load report, a count) and ``until(observation)`` says when it is the expected one; the
observation is returned. Past ``timeout`` it raises :class:`WaitTimeout`, an ``AssertionError``
naming what was awaited and the last observation, so a test fails with the state it was stuck
in. ``async_wait_until`` is the same for coroutines (the condition may be a coroutine function).
With ``alive``, a check that raises when a process the wait depends on died runs before every
poll, so that a crash fails at once (with its log) instead of running into the timeout.

The timeout bounds a hang; it is not a speed measurement: choose it generously.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypedDict, TypeVar, Unpack

T = TypeVar("T")

#: No observation yet (the condition raised an ignored exception every time, or never ran).
_NOTHING = object()


class WaitTimeout(AssertionError):
    """A condition did not hold within its timeout."""


class WaitOptions(TypedDict, total=False):
    """The options of :func:`wait_until` and :func:`async_wait_until`.

    ``interval``: seconds between polls (0.02). ``message``: what is awaited (a string, or a
    callable evaluated at the timeout, e.g. for a log tail). ``until``: accepts an observation
    (default: truthiness). ``ignoring``: exception types that count as "not yet" (e.g. a
    server not listening yet); any other exception propagates at once. ``alive``: runs before
    every poll and raises when something the wait depends on died.
    """

    interval: float
    message: str | Callable[[], str]
    until: Callable[[Any], object]
    ignoring: tuple[type[BaseException], ...]
    alive: Callable[[], None]


class _Poll:
    """The bookkeeping shared by the sync and async loops: deadline, last value, last error."""

    def __init__(self, timeout: float, options: WaitOptions) -> None:
        self.timeout = timeout
        self.options = options
        self.ignoring = options.get("ignoring", ())
        self.deadline = time.monotonic() + timeout
        self.last: object = _NOTHING
        self.error: BaseException | None = None

    def check_alive(self) -> None:
        alive = self.options.get("alive")
        if alive is not None:
            alive()

    def is_done(self, value: Any) -> bool:
        until = self.options.get("until")
        if bool(until(value)) if until is not None else bool(value):
            return True
        self.last = value
        return False

    def pause(self) -> float:
        """Seconds to sleep before the next poll; raises :class:`WaitTimeout` past the deadline."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self._timeout_error()
        return min(self.options.get("interval", 0.02), remaining)

    def _timeout_error(self) -> WaitTimeout:
        if self.last is not _NOTHING:
            seen = f"last value: {self.last!r}"
        elif self.error is not None:
            seen = f"last error: {self.error!r}"
        else:
            seen = "no value"
        message = self.options.get("message", "the condition")
        what = message() if callable(message) else message
        return WaitTimeout(f"timed out after {self.timeout:g} s waiting for {what} ({seen})")


def wait_until(condition: Callable[[], T], timeout: float, **options: Unpack[WaitOptions]) -> T:
    """Poll ``condition()`` until it is truthy (or ``until`` accepts it); return that value.

    The options are :class:`WaitOptions`'.
    """
    poll = _Poll(timeout, options)
    while True:
        poll.check_alive()
        try:
            value = condition()
        except poll.ignoring as exc:
            poll.error = exc
        else:
            if poll.is_done(value):
                return value
        time.sleep(poll.pause())


async def async_wait_until(
    condition: Callable[[], T | Awaitable[T]], timeout: float, **options: Unpack[WaitOptions]
) -> T:
    """:func:`wait_until` for async code: sleeps with ``asyncio.sleep``, and awaits the
    condition's result when it is awaitable (a coroutine function works as a condition)."""
    poll = _Poll(timeout, options)
    while True:
        poll.check_alive()
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except poll.ignoring as exc:
            poll.error = exc
        else:
            if poll.is_done(value):
                return value  # type: ignore[return-value]
        await asyncio.sleep(poll.pause())


# -- metrics ---------------------------------------------------------------------------------


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` (Prometheus text) whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def metric_value(text: str, sample: str) -> float:
    """The value of the Prometheus sample line starting with ``sample`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
