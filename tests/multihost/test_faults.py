"""Network faults on one server host under a concurrent load, as the callers see them.

Each test runs a steady load through the gateway (across the bridge), hits host ``cb2`` with a
fault, heals it, and asserts: every request got an answer or a clean error within its timeout
(none hung, none ended uncleanly), the gateway marked the host down within two heartbeat
intervals plus the health timeout (for the faults that cut it off), and the host got traffic
again after it healed. The rows of the README's fault table come from here
(``MULTIHOST_FAULT_TABLE=path.json`` writes them; ``-s`` prints them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness.waiting import wait_until
from tests.multihost.conftest import MARK_BOUND_SECONDS, Hosts
from tests.multihost.load import LoadRun

#: The callers' own bound per request: far above a healthy answer, so "hung" means hung.
REQUEST_TIMEOUT_SECONDS = 30.0
CONCURRENCY = 8
#: Slack for polling /backends every 50 ms and for the refresh's own duration.
POLL_SLACK_SECONDS = 0.5

_rows: list[dict[str, Any]] = []


@pytest.fixture(scope="module", autouse=True)
def _fault_table() -> Iterator[None]:
    yield
    print("\nfault table:\n" + "\n".join(json.dumps(row) for row in _rows))
    target = os.environ.get("MULTIHOST_FAULT_TABLE")
    if target:
        with open(target, "w") as out:
            json.dump(_rows, out, indent=2)


def _exercise(
    deployment: Hosts,
    fault: str,
    apply: Callable[[], str | None],
    *,
    is_cut_off: bool,
    hold_seconds: float = 3.0,
) -> dict[str, Any]:
    """Load, fault on cb2, hold, heal; returns the table row (after the common assertions)."""
    host, url, http = deployment.host("cb2"), deployment.url("cb2"), deployment.http
    # Start from a healthy host: after a lossy link heals, one more heartbeat on a connection
    # that died under the loss may mark cb2 down once more before it settles.
    wait_until(
        lambda: deployment.backend(url)["is_healthy"],
        MARK_BOUND_SECONDS + 5,
        interval=0.05,
        message="cb2 healthy before the fault",
    )
    load = LoadRun(str(http.base_url).rstrip("/"), CONCURRENCY, REQUEST_TIMEOUT_SECONDS).start()
    wait_until(lambda: len(load.outcomes) >= 2 * CONCURRENCY, 60, message="load warming up")
    applied_at = time.monotonic()
    how = apply() or fault
    seconds_to_down: float | None = None
    if is_cut_off:
        wait_until(
            lambda: not deployment.backend(url)["is_healthy"],
            MARK_BOUND_SECONDS + 5,
            interval=0.05,
            message=f"cb2 marked down after {fault}",
        )
        seconds_to_down = time.monotonic() - applied_at
    deadline = time.monotonic() + hold_seconds
    while time.monotonic() < deadline:  # a lossy host may flap: note when it first went down
        if seconds_to_down is None and not deployment.backend(url)["is_healthy"]:
            seconds_to_down = time.monotonic() - applied_at
        time.sleep(0.05)
    requests_before_heal = deployment.backend(url)["num_requests"]
    healed_at = time.monotonic()
    host.heal()
    wait_until(
        lambda: deployment.backend(url)["is_healthy"],
        MARK_BOUND_SECONDS + 5,
        interval=0.05,
        message=f"cb2 back after healing {fault}",
    )
    seconds_to_back = time.monotonic() - healed_at
    # Traffic again: the load keeps running until the healed host has served some of it.
    wait_until(
        lambda: deployment.backend(url)["num_requests"] > requests_before_heal,
        20,
        interval=0.05,
        message="traffic on cb2 again",
    )
    counts = load.stop()
    total = len(load.outcomes)
    row = {
        "fault": fault,
        "applied": how,
        "requests": total,
        "ok": counts["ok"],
        "clean_errors": counts["error"],
        "hung": counts["hung"],
        "unclean": counts["unclean"],
        "seconds_to_mark_down": None if seconds_to_down is None else round(seconds_to_down, 2),
        "seconds_back": round(seconds_to_back, 2),
        "slowest_request_seconds": round(max(o.seconds for o in load.outcomes), 2),
    }
    _rows.append(row)
    details = sorted({o.detail for o in load.outcomes if o.kind != "ok"})
    assert counts["hung"] == 0, (row, details)
    assert counts["unclean"] == 0, (row, details)
    assert counts["ok"] + counts["error"] == total
    assert counts["ok"] > 0
    assert seconds_to_back <= MARK_BOUND_SECONDS + POLL_SLACK_SECONDS, row
    return row


def test_link_down_under_load(deployment: Hosts) -> None:
    host = deployment.host("cb2")
    row = _exercise(
        deployment, "link down (cable pulled)", lambda: host.link(False), is_cut_off=True
    )
    assert row["seconds_to_mark_down"] <= MARK_BOUND_SECONDS + POLL_SLACK_SECONDS, row
    # Only requests that were streaming from cb2 when it was cut may fail (with an error event).
    assert row["clean_errors"] <= CONCURRENCY, row


def test_packet_loss_and_delay(deployment: Hosts) -> None:
    host = deployment.host("cb2")
    row = _exercise(
        deployment,
        "20% loss + 200 ms delay",
        lambda: host.lose(20, 200, deployment.folder / "cb2_delay.log"),
        is_cut_off=False,
        hold_seconds=8.0,
    )
    # A lossy link slows answers (TCP retransmits) and may flap the host; callers still get
    # answers or clean errors, and most of them answers.
    assert row["ok"] >= row["requests"] // 2, row


def test_silent_drop_hangs_connections_not_callers(deployment: Hosts) -> None:
    host = deployment.host("cb2")
    row = _exercise(deployment, "silent drop (iptables DROP)", host.drop_all, is_cut_off=True)
    assert row["seconds_to_mark_down"] <= MARK_BOUND_SECONDS + POLL_SLACK_SECONDS, row
    assert row["clean_errors"] <= CONCURRENCY, row
