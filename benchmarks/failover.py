"""Failover under load: two real CB servers behind a real gateway, one SIGKILLed halfway.

Starts two continuous-batching server processes with the default model and a gateway process
over them, sends ``--num-requests`` requests (half streaming chat, half plain completions,
``--concurrency`` at a time), SIGKILLs one server once ``--kill-after`` requests have finished,
then restarts it and checks that it gets traffic again. Prints (and optionally writes) what the
callers saw: successes, errors, hangs, the gateway's retries and fallbacks, how many attempts
were in flight on the killed server, and how long the gateway took to mark it down and up.

Run: ``python -m benchmarks.failover --json benchmarks/results/failover.json``
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks import print_report
from harness.processes import START_TIMEOUT_SECONDS, Deployment
from harness.waiting import metric_sum

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Count from one to five.",
    "Say hello in Spanish.",
    "What is two plus two?",
]
#: Longest wait for any one request: a request that takes longer counts as hung.
REQUEST_TIMEOUT_SECONDS = 120.0


@dataclass
class FailoverReport:
    """What the load looked like from the callers' side and from the gateway's metrics."""

    num_requests: int
    num_succeeded: int = 0
    num_errors: int = 0
    num_hung: int = 0
    error_messages: list[str] = field(default_factory=list)
    #: Attempts on the killed server that broke mid-answer (the requests in flight at the kill).
    num_broken_on_killed: int = 0
    #: The gateway's in-flight count on the killed server just before the kill.
    num_in_flight_at_kill: int = 0
    num_retries: int = 0
    #: Streams that broke off on the killed server and went on from the other one.
    num_resumed: int = 0
    num_fallbacks: int = 0
    seconds_to_mark_down: float | None = None
    seconds_to_mark_up: float | None = None
    num_requests_on_returned_server: int = 0
    heartbeat_interval_seconds: float = 0.0
    duration_seconds: float = 0.0


async def one_request(client: httpx.AsyncClient, base: str, index: int, max_tokens: int) -> str:
    """Send request ``index``; returns "ok", "hung" or an error description."""
    prompt = PROMPTS[index % len(PROMPTS)]
    try:
        if index % 2 == 0:
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "stream": True,
            }
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    return f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and '"error"' in line:
                        return f"stream error event: {line[:200]}"
            return "ok"
        body = {"prompt": prompt, "max_tokens": max_tokens}
        response = await client.post(f"{base}/v1/completions", json=body)
        return "ok" if response.status_code == 200 else f"HTTP {response.status_code}"
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


async def run_failover(
    num_requests: int = 200,
    concurrency: int = 16,
    max_tokens: int = 8,
    kill_after: int | None = None,
    heartbeat_interval: float = 1.0,
    num_threads: int = 1,
) -> FailoverReport:
    """Run the whole scenario and return its report (see the module docstring)."""
    kill_after = num_requests // 2 if kill_after is None else kill_after
    report = FailoverReport(num_requests, heartbeat_interval_seconds=heartbeat_interval)
    with tempfile.TemporaryDirectory(prefix="failover-") as folder:
        deployment = Deployment(Path(folder), heartbeat_interval, num_threads, num_servers=2)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_SECONDS, connect=5)
        limits = httpx.Limits(max_connections=concurrency + 8)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            try:
                await deployment.start_all(client)
                await _load_with_kill(
                    client, deployment, report, concurrency, max_tokens, kill_after
                )
                await _server_returns(client, deployment, report, max_tokens)
            finally:
                deployment.stop()
    return report


async def _load_with_kill(
    client: httpx.AsyncClient,
    deployment: Deployment,
    report: FailoverReport,
    concurrency: int,
    max_tokens: int,
    kill_after: int,
) -> None:
    base, victim = deployment.gateway_url, deployment.server_url(0)
    semaphore = asyncio.Semaphore(concurrency)
    num_done = 0
    kill_event = asyncio.Event()

    async def send(index: int) -> str:
        nonlocal num_done
        async with semaphore:
            outcome = await one_request(client, base, index, max_tokens)
        num_done += 1
        if num_done == kill_after:
            kill_event.set()
        return outcome

    async def killer() -> None:
        await kill_event.wait()
        rows = (await client.get(f"{base}/backends")).json()["backends"]
        report.num_in_flight_at_kill = next(r["num_in_flight"] for r in rows if r["url"] == victim)
        deployment.kill("cb_0")
        report.seconds_to_mark_down = await deployment.wait_backends(
            client,
            lambda rows: not next(r for r in rows if r["url"] == victim)["is_healthy"],
            "the killed server to be marked down",
        )

    start = time.monotonic()
    killer_task = asyncio.create_task(killer())
    outcomes = await asyncio.gather(*(send(i) for i in range(report.num_requests)))
    await asyncio.wait_for(killer_task, START_TIMEOUT_SECONDS)
    report.duration_seconds = round(time.monotonic() - start, 2)
    report.num_succeeded = outcomes.count("ok")
    report.num_hung = outcomes.count("hung")
    errors = [o for o in outcomes if o not in ("ok", "hung")]
    report.num_errors = len(errors)
    report.error_messages = errors[:10]
    metrics = (await client.get(f"{base}/metrics")).text
    report.num_retries = int(metric_sum(metrics, "gateway_retries_total"))
    report.num_fallbacks = int(metric_sum(metrics, "gateway_fallbacks_total"))
    report.num_resumed = int(metric_sum(metrics, "gateway_resumed_streams_total"))
    report.num_broken_on_killed = int(
        metric_sum(metrics, "gateway_requests_total", backend=victim, outcome="upstream_broken")
    )


async def _server_returns(
    client: httpx.AsyncClient, deployment: Deployment, report: FailoverReport, max_tokens: int
) -> None:
    base, victim = deployment.gateway_url, deployment.server_url(0)

    def victim_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return next(row for row in rows if row["url"] == victim)

    deployment.start_server(0)
    report.seconds_to_mark_up = await deployment.wait_backends(
        client, lambda rows: victim_row(rows)["is_healthy"], "the server to return"
    )
    before = victim_row((await client.get(f"{base}/backends")).json()["backends"])["num_requests"]
    await asyncio.gather(*(one_request(client, base, i, max_tokens) for i in range(1, 21, 2)))
    after = victim_row((await client.get(f"{base}/backends")).json()["backends"])["num_requests"]
    report.num_requests_on_returned_server = after - before
    for key in ("seconds_to_mark_down", "seconds_to_mark_up"):
        value = getattr(report, key)
        setattr(report, key, None if value is None else round(value, 2))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=200, help="default: %(default)s")
    parser.add_argument("--concurrency", type=int, default=16, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=8, help="default: %(default)s")
    parser.add_argument(
        "--kill-after", type=int, default=None, help="finished requests before the kill (half)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per server")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the scenario and print the report."""
    options = vars(parse_args(argv))  # named as run_failover's parameters
    path = options.pop("json")
    print_report(asyncio.run(run_failover(**options)), path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
