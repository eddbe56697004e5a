"""One gateway process's ceiling: requests/s it relays when the model server costs nothing.

Starts a fake model server process (``harness.fake_server``: instant answers, ``--events``
SSE chunks per streamed chat, no delay) and a gateway process over it, then sends streaming
chats from ``--concurrency`` callers for ``--seconds`` per level. Besides requests/s and
latency, it reads the gateway process's CPU time (``/proc/<pid>/stat``) around each level:
CPU seconds per request is what decides the ceiling of a one-process gateway (one event loop
on one core), and it holds up better than requests/s on a machine whose cores are shared.

Run: ``python -m benchmarks.gateway_ceiling --json benchmarks/results/gateway_ceiling.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from harness.fake_server import fake_servers_args
from harness.network import free_port
from harness.processes import Deployment
from harness.waiting import wait_until

MODEL = "fake-model"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_chat(client: httpx.AsyncClient, base: str) -> bool:
    """One streaming chat through the gateway; True when it ended with [DONE]."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            return False
        last = b""
        async for chunk in answer.aiter_raw():
            last = (last + chunk)[-32:]
        return b"[DONE]" in last


async def run_level(base: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """``concurrency`` callers back to back for ``seconds``; latencies and counts."""
    latencies: list[float] = []
    failures = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as client:

        async def caller() -> None:
            nonlocal failures
            while time.monotonic() < deadline:
                start = time.monotonic()
                if await stream_chat(client, base):
                    latencies.append(time.monotonic() - start)
                else:
                    failures += 1

        started = time.monotonic()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    latencies.sort()
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 2),
        "completed": len(latencies),
        "failed": failures,
        "requests_per_second": round(len(latencies) / elapsed, 1),
        "latency_p50_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
        "latency_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 1)
        if latencies
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Start the two processes, measure each level, print (and write) the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--events", type=int, default=8, help="SSE chunks per answer")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    deployment = Deployment(Path(tempfile.mkdtemp(prefix="gateway_ceiling_")), num_servers=0)
    server_port = free_port()
    fake = {"name": "f", "model_id": MODEL, "kind": "continuous_batching"}
    fake.update(num_stream_events=args.events, stream_delay_seconds=0)
    deployment.spawn("fake", fake_servers_args("127.0.0.1", {server_port: fake}))
    config = {
        "continuous_batching_server_urls": [f"http://127.0.0.1:{server_port}"],
        "heart_beat_interval_seconds": 10,
        "config_watch_interval_seconds": 0,
    }
    deployment.start_gateway(config)
    gateway, base = deployment.processes["gateway"], deployment.gateway_url
    try:
        wait_until(
            lambda: MODEL in httpx.get(f"{base}/v1/models", timeout=1, trust_env=False).text,
            30,
            interval=0.1,
            ignoring=(httpx.HTTPError,),
            alive=deployment.check_alive,
            message="the gateway to route the fake model",
        )
        asyncio.run(run_level(base, 4, 1.0))  # warm-up: connections, code paths
        levels = []
        for concurrency in args.concurrency:
            load_before, cpu_before = os.getloadavg()[0], cpu_seconds(gateway.pid)
            level = asyncio.run(run_level(base, concurrency, args.seconds))
            cpu = cpu_seconds(gateway.pid) - cpu_before
            per_request = cpu / max(1, level["completed"])
            level.update(
                load_average_at_start=round(load_before, 2),
                gateway_cpu_seconds=round(cpu, 2),
                gateway_cpu_ms_per_request=round(per_request * 1000, 3),
                ceiling_requests_per_second_per_core=round(1 / per_request, 1),
            )
            levels.append(level)
            print(json.dumps(level), flush=True)
    finally:
        deployment.stop(timeout=10)
    result = {"events_per_answer": args.events, "cpu_cores": os.cpu_count(), "levels": levels}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
