"""The waiting helper itself: what it returns, and what a timeout says (milliseconds)."""

from __future__ import annotations

import itertools

import pytest

from harness.waiting import WaitTimeout, async_wait_until, wait_until


def test_returns_the_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter) >= 3 and "done", 5, interval=0.001) == "done"


def test_until_decides_and_the_observation_is_returned() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 5, interval=0.001, until=lambda n: n == 4) == 4


def test_timeout_names_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for the count to reach 9 \(last value: 2\)"):
        wait_until(
            lambda: 2, 0.05, interval=0.01, until=lambda n: n == 9, message="the count to reach 9"
        )
    # A WaitTimeout is an AssertionError: a test fails, it does not error.
    assert issubclass(WaitTimeout, AssertionError)


def test_message_may_be_computed_at_the_timeout() -> None:
    log = ["starting"]

    def not_yet() -> bool:
        log.append("still starting")
        return False

    with pytest.raises(WaitTimeout, match=r"the server; log: starting, still starting"):
        wait_until(
            not_yet, 0.02, interval=0.01, message=lambda: "the server; log: " + ", ".join(log)
        )


def test_ignored_errors_mean_not_yet_and_the_last_one_is_reported() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("not listening yet")

    with pytest.raises(WaitTimeout, match=r"last error: ConnectionRefusedError\('not listening"):
        wait_until(refused, 0.02, interval=0.01, ignoring=(ConnectionError,))
    attempts = iter([ConnectionRefusedError(), ConnectionRefusedError(), "up"])

    def flaky() -> str:
        outcome = next(attempts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert wait_until(flaky, 5, interval=0.001, ignoring=(ConnectionError,)) == "up"


def test_other_errors_propagate_at_once() -> None:
    def broken() -> bool:
        raise RuntimeError("the server exited")

    with pytest.raises(RuntimeError, match="the server exited"):
        wait_until(broken, 60, ignoring=(ConnectionError,))


async def test_async_variant_takes_sync_and_async_conditions() -> None:
    counter = itertools.count()

    async def observe() -> int:
        return next(counter)

    assert await async_wait_until(observe, 5, interval=0.001, until=lambda n: n == 3) == 3
    assert await async_wait_until(lambda: next(counter), 5, interval=0.001) == 4
    with pytest.raises(WaitTimeout, match=r"waiting for nothing \(last value: 0\)"):
        await async_wait_until(lambda: 0, 0.02, interval=0.01, message="nothing")
