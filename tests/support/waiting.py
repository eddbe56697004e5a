"""Waiting for a condition with a deadline: the one polling loop of the tests.

``wait_until(condition, timeout)`` calls ``condition()`` every ``interval`` seconds until it
gives a truthy value, and returns that value. With ``until``, ``condition()`` is an observation
(a load report, a count) and ``until(observation)`` says when it is the expected one; the
observation is returned. Past ``timeout`` it raises :class:`WaitTimeout`, an ``AssertionError``
naming what was awaited and the last observation, so a test fails with the state it was stuck
in. ``async_wait_until`` is the same for coroutines (the condition may be a coroutine function).

The timeout bounds a hang; it is not a speed measurement: choose it generously.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: No observation yet (the condition raised an ignored exception every time, or never ran).
_NOTHING = object()


class WaitTimeout(AssertionError):
    """A condition did not hold within its timeout."""


def _describe(message: str | Callable[[], str]) -> str:
    return message() if callable(message) else message


def _timeout_error(
    timeout: float, message: str | Callable[[], str], last: object, error: BaseException | None
) -> WaitTimeout:
    if last is not _NOTHING:
        seen = f"last value: {last!r}"
    elif error is not None:
        seen = f"last error: {error!r}"
    else:
        seen = "no value"
    return WaitTimeout(f"timed out after {timeout:g} s waiting for {_describe(message)} ({seen})")


def _is_done(value: Any, until: Callable[[Any], object] | None) -> bool:
    return bool(until(value)) if until is not None else bool(value)


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    *,
    interval: float = 0.02,
    message: str | Callable[[], str] = "the condition",
    until: Callable[[T], object] | None = None,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``condition()`` until it is truthy (or ``until`` accepts it); return that value.

    ``message`` (a string, or a callable evaluated at the timeout, e.g. for a log tail) says
    what is awaited. Exceptions of the types in ``ignoring`` count as "not yet" (e.g. a server
    not listening yet); any other exception propagates at once.
    """
    deadline = time.monotonic() + timeout
    last: object = _NOTHING
    error: BaseException | None = None
    while True:
        try:
            value = condition()
        except ignoring as exc:
            error = exc
        else:
            if _is_done(value, until):
                return value
            last = value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(timeout, message, last, error)
        time.sleep(min(interval, remaining))


async def async_wait_until(
    condition: Callable[[], T | Awaitable[T]],
    timeout: float,
    *,
    interval: float = 0.02,
    message: str | Callable[[], str] = "the condition",
    until: Callable[[T], object] | None = None,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """:func:`wait_until` for async tests: sleeps with ``asyncio.sleep``, and awaits the
    condition's result when it is awaitable (a coroutine function works as a condition)."""
    deadline = time.monotonic() + timeout
    last: object = _NOTHING
    error: BaseException | None = None
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as exc:
            error = exc
        else:
            if _is_done(value, until):
                return value  # type: ignore[return-value]
            last = value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout_error(timeout, message, last, error)
        await asyncio.sleep(min(interval, remaining))
