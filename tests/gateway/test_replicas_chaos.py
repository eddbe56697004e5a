"""Two gateway replicas sharing state through one real redis-server, under chaos (#26 item 5).

Real processes over real sockets: redis-server (with a password), two ``client_app.py``
replicas, and one process of echo model servers whose answer is the prompt reversed, so that
any wrong answer is seen. The scenarios live in ``benchmarks/replicas_chaos.py`` (which also
prints them as a report); here they run with smaller loads and their figures are asserted:

- Redis SIGKILLed and restarted under load: no request fails, each replica warns once and goes
  on with its own state, the outage's opening and new ones reach the other replica.
- A replica SIGKILLed under load, the client retrying on the other before any byte: every
  request that had not started completes; only answers already streaming on the killed
  replica are lost; none is wrong; a restarted replica adopts the openings from Redis.
- A replica cut off from Redis (a black-holing proxy), twice: it serves on with local state,
  warns once per outage, and both replicas converge once it is reconnected.

Convergence is bounded by ``CONVERGE_TIMEOUT_SECONDS`` (5 s: the design's 0.5 s sync interval
plus its 0.5 s Redis timeout, with room for a loaded 2-core machine), never timed finer.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from benchmarks.replicas_chaos import (
    ScenarioReport,
    scenario_cutoff,
    scenario_kill,
    scenario_redis,
)
from harness.redis_server import MISSING, is_redis_installed
from harness.replicas import CONVERGE_TIMEOUT_SECONDS

#: Bounds a hang of a whole scenario (each of its waits has its own, shorter timeout).
SCENARIO_TIMEOUT_SECONDS = 120


@pytest.fixture(autouse=True)
def _needs_redis() -> None:
    if not is_redis_installed():
        if os.environ.get("CI"):
            pytest.fail(MISSING)
        pytest.skip(MISSING)


def _assert_common(report: ScenarioReport) -> None:
    """What holds in every scenario: nothing lost that had not started, nothing wrong, no
    hang, every check as designed, state converged within the bound, no password in a log."""
    load = report.load
    assert load.num_sent > 0, report
    assert load.num_lost_not_started == 0, report
    assert load.num_wrong == 0, report
    assert load.num_hung == 0, report
    assert load.num_ok + load.num_lost_in_flight == load.num_sent, report
    assert report.checks and all(report.checks.values()), report.checks
    assert report.convergence_seconds, report
    # A failed convergence raises in the scenario; this states the bound in the test too.
    assert all(0 <= s <= CONVERGE_TIMEOUT_SECONDS for s in report.convergence_seconds.values())
    assert not report.is_secret_logged, report


async def test_redis_killed_and_restarted_under_load(tmp_path: Path) -> None:
    report = await asyncio.wait_for(
        scenario_redis(tmp_path, concurrency=6, outage_seconds=1.5), SCENARIO_TIMEOUT_SECONDS
    )
    _assert_common(report)
    # No replica died: every request answered, none failed because of Redis.
    assert report.load.num_ok == report.load.num_sent, report
    assert report.load.num_retried_refused == report.load.num_retried_no_byte == 0, report
    assert report.num_warnings == {"A": 1, "B": 1}, report  # one per replica per outage
    assert {
        "breaker A->B made during outage, from restart",
        "breaker A->B after restart",
        "cooldown A->B after restart",
    } <= set(report.convergence_seconds)


async def test_replica_killed_under_load_clients_retry_on_the_other(tmp_path: Path) -> None:
    report = await asyncio.wait_for(
        scenario_kill(tmp_path, num_requests=120, concurrency=12, kill_after=40),
        SCENARIO_TIMEOUT_SECONDS,
    )
    _assert_common(report)
    load = report.load
    # The kill was felt: requests went to B after A refused them...
    assert load.num_retried_refused > 0, report
    # ...and only answers already under way on A were lost (bounded by what A had in flight).
    assert load.num_lost_in_flight <= 12, report
    assert {"breaker, restarted replica", "cooldown, restarted replica"} <= set(
        report.convergence_seconds
    )


async def test_replica_cut_off_from_redis_keeps_serving_and_converges(tmp_path: Path) -> None:
    report = await asyncio.wait_for(
        scenario_cutoff(tmp_path, concurrency=6, outage_seconds=1.5), SCENARIO_TIMEOUT_SECONDS
    )
    _assert_common(report)
    assert report.load.num_ok == report.load.num_sent, report
    # Two outages of A: two warnings on A (not one per failed call), none on B.
    assert report.num_warnings == {"A": 2, "B": 0}, report
    assert {
        "breaker B->A after reconnect",
        "breaker A->B after reconnect",
        "cooldown A->B after reconnect",
    } <= set(report.convergence_seconds)
