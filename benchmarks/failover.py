"""Failover under load: two real CB servers behind a real gateway, one SIGKILLed halfway.

Starts two continuous-batching server processes with the default model and a gateway process
over them, sends ``--num-requests`` requests (half streaming chat, half plain completions,
``--concurrency`` at a time), SIGKILLs one server once ``--kill-after`` requests have finished,
then restarts it and checks that it gets traffic again. Prints (and optionally writes) what the
callers saw: successes, errors, hangs, the gateway's retries and fallbacks, how many attempts
were in flight on the killed server, and how long the gateway took to mark it down and up.

Run: ``python benchmarks/failover.py --json benchmarks/results/failover.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make the project importable
    sys.path.insert(0, str(REPO_ROOT))

from tools.prepare_model import default_model_dir  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Count from one to five.",
    "Say hello in Spanish.",
    "What is two plus two?",
]
#: Longest wait for any one request: a request that takes longer counts as hung.
REQUEST_TIMEOUT_SECONDS = 120.0
#: Longest wait for a process to become ready.
START_TIMEOUT_SECONDS = 180.0


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


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


class Deployment:
    """Server and gateway processes in a temporary folder, stopped together."""

    def __init__(
        self,
        folder: Path,
        heartbeat_interval: float,
        num_threads: int,
        num_servers: int = 2,
        dtype: str = "bfloat16",
    ) -> None:
        self.folder = folder
        self.heartbeat_interval = heartbeat_interval
        self.num_threads = num_threads
        self.dtype = dtype
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.server_ports = [free_port() for _ in range(num_servers)]
        self.gateway_port = free_port()

    @property
    def gateway_url(self) -> str:
        """The gateway's address."""
        return f"http://127.0.0.1:{self.gateway_port}"

    def server_url(self, index: int) -> str:
        """The address of server ``index``."""
        return f"http://127.0.0.1:{self.server_ports[index]}"

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 (owned by the process)
        self.processes[name] = subprocess.Popen(
            [sys.executable, *args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def start_server(self, index: int) -> None:
        """Start CB server ``index`` (again, after a kill)."""
        config = {
            "model_loading_config": {
                "model_name_or_path": str(default_model_dir()),
                "torch_dtype": self.dtype,
                "num_threads": self.num_threads,
            },
            "cache_config": {"memory_budget_gb": 0.25, "num_blocks_cpu": 64},
        }
        path = self.folder / f"cb_{index}.json"
        path.write_text(json.dumps(config))
        args = ["continuous_batching_server_app.py", "--config", str(path)]
        self._spawn(f"cb_{index}", [*args, "--port", str(self.server_ports[index])])

    def start_gateway(self) -> None:
        """Start the gateway over every server."""
        config = {
            "continuous_batching_server_urls": [
                self.server_url(i) for i in range(len(self.server_ports))
            ],
            "heart_beat_interval_seconds": self.heartbeat_interval,
            "num_failures_to_mark_down": 2,
            "health_timeout_seconds": 1,
            "connect_timeout_seconds": 1,
            "request_timeout_seconds": 60,
        }
        path = self.folder / "client.json"
        path.write_text(json.dumps(config))
        args = ["client_app.py", "--config", str(path), "--log-level", "warning"]
        self._spawn("gateway", [*args, "--port", str(self.gateway_port)])

    def kill(self, name: str) -> None:
        """SIGKILL a process: no clean-up, connections reset, like a crash."""
        process = self.processes[name]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)

    def stop(self) -> None:
        """Terminate every process (kill those that do not exit in time)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    def check_alive(self) -> None:
        """Raise with the log's tail if a process exited unexpectedly."""
        for name, process in self.processes.items():
            if process.poll() is not None and process.returncode != -signal.SIGKILL:
                tail = (self.folder / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {process.returncode}:\n{tail}")


async def wait_until(
    client: httpx.AsyncClient, deployment: Deployment, predicate: Any, what: str
) -> float:
    """Poll the gateway's /backends until ``predicate(rows)``; returns the seconds it took."""
    start = time.monotonic()
    while True:
        deployment.check_alive()
        try:
            response = await client.get(f"{deployment.gateway_url}/backends", timeout=5)
            if response.status_code == 200 and predicate(response.json()["backends"]):
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() - start > START_TIMEOUT_SECONDS:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


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
        deployment = Deployment(Path(folder), heartbeat_interval, num_threads)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_SECONDS, connect=5)
        limits = httpx.Limits(max_connections=concurrency + 8)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            try:
                for index in (0, 1):
                    deployment.start_server(index)
                deployment.start_gateway()
                await wait_until(
                    client,
                    deployment,
                    lambda rows: all(row["is_healthy"] for row in rows),
                    "both servers to be healthy",
                )
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
        report.seconds_to_mark_down = await wait_until(
            client,
            deployment,
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
    report.seconds_to_mark_up = await wait_until(
        client, deployment, lambda rows: victim_row(rows)["is_healthy"], "the server to return"
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
    args = parse_args(argv)
    report = asyncio.run(
        run_failover(
            args.num_requests,
            args.concurrency,
            args.max_tokens,
            args.kill_after,
            args.heartbeat_interval,
            args.num_threads,
        )
    )
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
