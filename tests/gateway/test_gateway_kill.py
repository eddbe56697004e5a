"""A real CB server SIGKILLed under a 200-request load behind a real gateway (all processes).

Costs no request: non-streaming ones and streams that had not sent a byte are retried on the
other server, and streams that had started are resumed there (``client.forwarding.resume``).
Nothing hangs; the gateway marks the server down within two heartbeat intervals; once
restarted it gets traffic again.
"""

from __future__ import annotations

import asyncio

from benchmarks.failover import run_failover


def test_sigkill_under_load_costs_no_request() -> None:
    concurrency, interval = 16, 1.0
    report = asyncio.run(
        run_failover(num_requests=200, concurrency=concurrency, heartbeat_interval=interval)
    )
    assert report.num_hung == 0, report
    assert report.num_succeeded + report.num_errors == 200, report
    assert 0 < report.num_broken_on_killed <= concurrency, report
    assert report.num_errors == 0, report
    # Two failed heartbeats mark it down; the bound allows for the health timeout (1 s) of the
    # second one. It bounds a hang, it is not a speed measurement.
    assert report.seconds_to_mark_down is not None
    assert report.seconds_to_mark_down <= 2 * interval + 1.0, report
    assert report.num_requests_on_returned_server > 0, report
