"""Two gateway replicas sharing circuit state through Redis, under chaos (issue #26, item 5).

Every part is a real process on real sockets (``harness.replicas``): one ``redis-server`` with a
password, two gateway replicas over it, and one process of echo model servers whose answer is
the prompt's words reversed, so a wrong answer cannot pass for right; backends ``f1``-``f3``
fail every request (a *breaker* opening takes two) and the upstream ``up`` rests a jumper key
with a 429 (a *cooldown*).

Scenarios (each on a fresh cluster):

- ``redis``: under load, Redis is SIGKILLed and restarted on its port (empty). The replicas go
  on with their own state; an opening made during the outage reaches the other replica once
  Redis is back, and openings made after the restart converge as before.
- ``kill``: under concurrent load spread over both replicas, replica A is SIGKILLed. The load's
  client behaves like a load balancer: a request that got no byte from a replica (connection
  refused, or closed before the status line) is sent to the other one. Then A is restarted and
  must adopt the openings the other replica holds.
- ``cutoff``: replica A reaches Redis through a TCP proxy that starts black-holing (accepts,
  forwards nothing: every Redis call of A times out). A serves on with local state and logs one
  warning per outage; after the proxy forwards again both replicas converge.

Convergence is measured from the moment the request that opened a circuit on one replica
returned to the moment the other replica's ``/backends`` shows the circuit open (polled every
20 ms); a replica that starts is measured from its first healthy ``/health``.

Run: ``python -m benchmarks.replicas_chaos [--scenario all] [--json PATH]``; the tests in
``tests/gateway/test_replicas_chaos.py`` run the same scenarios with smaller loads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.replica_load import LoadReport, ReplicaClient, run_load
from harness.replicas import (
    CONVERGE_TIMEOUT_SECONDS,
    REDIS_PASSWORD,
    START_TIMEOUT_SECONDS,
    Cluster,
    Replica,
    seconds_until,
)


@dataclass
class ScenarioReport:
    """One scenario's figures."""

    scenario: str
    load: LoadReport
    #: Seconds for breaker / cooldown state to reach the other replica, by what was measured.
    convergence_seconds: dict[str, float] = field(default_factory=dict)
    #: Facts checked on the way (True: as designed), e.g. "B kept local state during outage".
    checks: dict[str, bool] = field(default_factory=dict)
    #: "shared state ... unreachable" warnings per replica.
    num_warnings: dict[str, int] = field(default_factory=dict)
    #: Whether the Redis password appeared in any replica's log.
    is_secret_logged: bool = False
    #: Requests the client had in flight on the replica it SIGKILLed (kill scenario).
    num_in_flight_at_kill: int | None = None
    duration_seconds: float = 0.0


@contextlib.asynccontextmanager
async def _fresh_cluster(
    folder: Path, scenario: str, proxied: tuple[str, ...] = ()
) -> AsyncIterator[tuple[Cluster, ScenarioReport]]:
    """A started cluster (replicas A and B) and the scenario's report; when the scenario is
    done, what the logs show (warnings, the password) and the duration, and the cluster stopped."""
    started = time.monotonic()
    cluster = Cluster(folder)
    report = ScenarioReport(scenario, LoadReport())
    try:
        await cluster.start(proxied=proxied)
        yield cluster, report
        logs = {name: replica.log_text() for name, replica in sorted(cluster.replicas.items())}
        report.num_warnings = {name: log.count("unreachable") for name, log in logs.items()}
        report.is_secret_logged = any(REDIS_PASSWORD in log for log in logs.values())
    finally:
        await cluster.stop()
    report.duration_seconds = time.monotonic() - started


@contextlib.asynccontextmanager
async def _under_load(
    cluster: Cluster, report: ScenarioReport, concurrency: int
) -> AsyncIterator[None]:
    """Load over replicas A and B (``concurrency`` at a time) while the block runs."""
    a, b = cluster.replicas["A"], cluster.replicas["B"]
    client = ReplicaClient([a.url, b.url], report.load)
    stop = asyncio.Event()
    task = asyncio.create_task(run_load(client, concurrency, stop=stop))
    try:
        yield
    finally:
        stop.set()
        await task
        await client.aclose()


async def _logged(replica: Replica, text: str, what: str, count: int = 1) -> None:
    """Wait until ``replica`` has logged ``text`` ``count`` times (each replica notices an
    outage or a reconnection on its own, at its next sync round)."""
    await seconds_until(
        lambda: replica.log_text().count(text) >= count,
        CONVERGE_TIMEOUT_SECONDS,
        what,
        replica.check_alive,
    )


async def scenario_redis(
    folder: Path, concurrency: int = 8, outage_seconds: float = 2.0
) -> ScenarioReport:
    """Redis SIGKILLed and restarted under load."""
    async with _fresh_cluster(folder, "redis") as (cluster, report):
        a, b = cluster.replicas["A"], cluster.replicas["B"]
        converged = report.convergence_seconds
        async with _under_load(cluster, report, concurrency):
            converged["breaker A->B, steady"] = await cluster.spread_seconds(a, b, "f1")
            report.checks["B's copy of the breaker ends with A's"] = await cluster.ends_together(
                a, b, cluster.url("f1")
            )
            cluster.redis.kill()
            for replica in (a, b):
                await _logged(replica, "unreachable", f"{replica.name}'s warning")
            # During the outage an opening on A stays A's own: B routes by its own state.
            await cluster.open_breaker(a, "f2")
            report.checks["outage: B keeps its own state"] = await cluster.stays_closed(
                b, cluster.url("f2"), outage_seconds
            )
            cluster.redis.start()
            await cluster.redis.wait_async()
            restarted_at = time.monotonic()
            # The outage's opening reaches B once Redis is back (A writes it again).
            converged[
                "breaker A->B made during outage, from restart"
            ] = await cluster.seconds_until_open(b, cluster.url("f2"), restarted_at)
            # New openings after the restart converge as before.
            converged["breaker A->B after restart"] = await cluster.spread_seconds(a, b, "f3")
            converged["cooldown A->B after restart"] = await cluster.spread_seconds(a, b)
            for replica in (a, b):
                await _logged(replica, "reachable again", f"{replica.name} reconnected")
            await asyncio.sleep(0.5)  # a little load after the restart too
    return report


async def scenario_kill(
    folder: Path, num_requests: int = 240, concurrency: int = 16, kill_after: int = 80
) -> ScenarioReport:
    """Replica A SIGKILLed under load; the clients retry on B; then A restarts."""
    async with _fresh_cluster(folder, "kill") as (cluster, report):
        a, b = cluster.replicas["A"], cluster.replicas["B"]
        converged = report.convergence_seconds
        # Openings made on B before the kill (A adopts them; so must A's successor).
        converged["breaker B->A, steady"] = await cluster.spread_seconds(b, a, "f1")
        converged["cooldown B->A, steady"] = await cluster.spread_seconds(b, a)
        report.checks["A's copy of the cooldown ends with B's"] = await cluster.ends_together(
            b, a, cluster.resting_key_row
        )
        client = ReplicaClient([a.url, b.url], report.load)
        load = asyncio.create_task(run_load(client, concurrency, num_requests))
        try:
            await seconds_until(
                lambda: report.load.num_ok >= kill_after,
                60,
                "the load's first answers",
                a.check_alive,
            )
            report.checks["requests in flight on A at the kill"] = client.in_flight[a.url] > 0
            in_flight_on_a = report.num_in_flight_at_kill = client.in_flight[a.url]
            cluster.kill_replica("A")
            await load
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            await client.aclose()
        report.checks["lost in flight <= in flight on A at the kill"] = (
            report.load.num_lost_in_flight <= in_flight_on_a
        )
        # The restarted replica (a new process) adopts B's openings from Redis.
        restarted = cluster.start_replica("A2")
        await seconds_until(
            lambda: cluster.is_ok(f"{restarted.url}/health"),
            START_TIMEOUT_SECONDS,
            "replica A2",
            restarted.check_alive,
        )
        since = time.monotonic()
        converged["breaker, restarted replica"] = await cluster.seconds_until_open(
            restarted, cluster.url("f1"), since
        )
        converged["cooldown, restarted replica"] = await cluster.seconds_until_open(
            restarted, cluster.resting_key_row, since
        )
        # ...and keeps traffic away from them without trying them itself.
        before = await cluster.num_requests("f1")
        body = {"model": "m-f1", "prompt": "stay away", "max_tokens": 4}
        status = (await cluster.http.post(f"{restarted.url}/v1/completions", json=body)).status_code
        report.checks["restarted replica keeps traffic off f1"] = (
            status == 503 and await cluster.num_requests("f1") == before
        )
    return report


async def scenario_cutoff(
    folder: Path, concurrency: int = 8, outage_seconds: float = 2.0
) -> ScenarioReport:
    """Replica A cut off from Redis (black-holed) under load, twice, then reconnected."""
    async with _fresh_cluster(folder, "cutoff", proxied=("A",)) as (cluster, report):
        a, b = cluster.replicas["A"], cluster.replicas["B"]
        converged = report.convergence_seconds
        proxy = cluster.proxies[0]
        async with _under_load(cluster, report, concurrency):
            proxy.cut()
            await _logged(a, "unreachable", "A's warning")
            # Each side's openings during the cut stay its own.
            await cluster.open_breaker(b, "f1")
            await cluster.open_breaker(a, "f2")
            await cluster.rest_key(a)
            closed_on_a = await cluster.stays_closed(a, cluster.url("f1"), outage_seconds)
            report.checks["cut: A keeps its own state"] = closed_on_a
            report.checks["cut: B keeps its own state"] = await cluster.stays_closed(
                b, cluster.url("f2"), 0.2
            )
            proxy.restore()
            restored_at = time.monotonic()
            # A reads B's opening; B gets A's openings made while it was cut off.
            converged["breaker B->A after reconnect"] = await cluster.seconds_until_open(
                a, cluster.url("f1"), restored_at
            )
            converged["breaker A->B after reconnect"] = await cluster.seconds_until_open(
                b, cluster.url("f2"), restored_at
            )
            converged["cooldown A->B after reconnect"] = await cluster.seconds_until_open(
                b, cluster.resting_key_row, restored_at
            )
            report.checks[
                "B's copy of A's outage cooldown ends with A's"
            ] = await cluster.ends_together(a, b, cluster.resting_key_row)
            await _logged(a, "reachable again", "A reconnected")
            # A second outage: a second warning (one per outage, not one per failed call).
            proxy.cut()
            await _logged(a, "unreachable", "A's second warning", count=2)
            await asyncio.sleep(outage_seconds / 2)
            proxy.restore()
            await _logged(a, "reachable again", "A reconnected again", count=2)
    return report


SCENARIOS = {"redis": scenario_redis, "kill": scenario_kill, "cutoff": scenario_cutoff}


def format_reports(reports: list[ScenarioReport]) -> str:
    """The reports as text tables (one row per scenario, then the convergence figures)."""
    lines = [
        "| scenario | sent | ok | wrong | lost, not started | lost in flight | retried (refused "
        "/ no byte) | hung | max latency s | outage warnings | password in logs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        load = report.load
        warnings = " ".join(f"{name}:{n}" for name, n in report.num_warnings.items())
        lines.append(
            f"| {report.scenario} | {load.num_sent} | {load.num_ok} | {load.num_wrong} | "
            f"{load.num_lost_not_started} | {load.num_lost_in_flight} | "
            f"{load.num_retried_refused} / {load.num_retried_no_byte} | {load.num_hung} | "
            f"{load.max_latency_seconds:.2f} | {warnings} | "
            f"{'yes' if report.is_secret_logged else 'no'} |"
        )
    lines += ["", "| scenario | state converged | seconds |", "|---|---|---|"]
    for report in reports:
        for what, seconds in report.convergence_seconds.items():
            lines.append(f"| {report.scenario} | {what} | {seconds:.2f} |")
    lines += ["", "| scenario | check | holds |", "|---|---|---|"]
    for report in reports:
        for what, holds in report.checks.items():
            lines.append(f"| {report.scenario} | {what} | {'yes' if holds else 'NO'} |")
    for report in reports:
        if report.num_in_flight_at_kill is not None:
            lines.append(
                f"{report.scenario}: {report.num_in_flight_at_kill} requests in flight on the "
                f"killed replica: {report.load.num_lost_in_flight} streams had begun (lost), "
                "the others had answered or had no byte yet (sent to the other replica)"
            )
        for error in report.load.errors:
            lines.append(f"{report.scenario}: {error}")
    return "\n".join(lines)


async def run_all(names: list[str], folder: Path) -> list[ScenarioReport]:
    """Run the scenarios ``names`` one after the other, each in a subfolder of ``folder``."""
    reports = []
    for name in names:
        sub = folder / name
        sub.mkdir(parents=True, exist_ok=True)
        reports.append(await SCENARIOS[name](sub))
    return reports


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--json", type=Path, help="also write the reports here")
    parser.add_argument("--keep-logs", type=Path, help="folder for the processes' logs")
    args = parser.parse_args(argv)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory(prefix="replicas-chaos-") as tmp:
        folder = args.keep_logs or Path(tmp)
        reports = asyncio.run(run_all(names, folder))
    print(format_reports(reports))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=2) + "\n")
    is_clean = all(
        r.load.num_lost_not_started == 0
        and r.load.num_wrong == 0
        and r.load.num_hung == 0
        and all(r.checks.values())
        and not r.is_secret_logged
        for r in reports
    )
    return 0 if is_clean else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
