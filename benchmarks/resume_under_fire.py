"""Streams that survive their server: ``--num-streams`` concurrent streams over three real CB
servers behind a real gateway, two of the servers SIGKILLed one after the other mid-stream.

All processes are real (the default model, float32, so that greedy text does not depend on
the batch), over real sockets. First every prompt is answered once, undisturbed; then the
streams start together (greedy completions, ``ignore_eos`` so that each runs its whole
budget, and optionally seeded sampling), server 0 is SIGKILLed once they are under way and
server 1 some seconds later. The gateway resumes every broken stream on a surviving server
(``client.forwarding.resume``). The report counts, from the callers' side: streams whose text
is identical to the undisturbed answer, different, ended with an error event, or hung; and
from the gateway's metrics: streams resumed by cause.

Run: ``python -m benchmarks.resume_under_fire [--num-streams 200] [--json FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import print_report
from harness.processes import RESUME_PROMPTS as PROMPTS
from harness.processes import Deployment
from harness.waiting import metric_sum

REQUEST_TIMEOUT_SECONDS = 180.0


@dataclass
class ResumeReport:
    """What the callers saw, and what the gateway counted."""

    num_streams: int
    num_identical: int = 0
    num_different: int = 0
    num_errors: int = 0
    num_hung: int = 0
    error_messages: list[str] = field(default_factory=list)
    num_resumed: int = 0
    resumed_by_cause: dict[str, int] = field(default_factory=dict)
    num_broken: int = 0
    seconds_between_kills: float = 0.0
    duration_seconds: float = 0.0


def _body(index: int, max_tokens: int, is_seeded: bool) -> dict[str, object]:
    body: dict[str, object] = {
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    if is_seeded and index % 2:
        body.update(temperature=0.8, seed=1000 + index % len(PROMPTS))
    return body


async def _stream(client: httpx.AsyncClient, base: str, body: dict[str, object]) -> str:
    """The streamed text, or "error: ..." / "hung"."""
    text = []
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            if response.status_code != 200:
                # The whole answer, with the request id to find it in the gateway's log.
                body = (await response.aread()).decode(errors="replace")[:300]
                request_id = response.headers.get("x-request-id", "?")
                return f"error: HTTP {response.status_code} ({request_id}): {body}"
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"error: {line[:200]}"
                text += [c["text"] for c in chunk["choices"]]
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as exc:
        return f"error: {type(exc).__name__}: {exc}"
    return "".join(text)


async def run_resume(
    num_streams: int = 200,
    max_tokens: int = 48,
    first_kill_after: float = 2.0,
    seconds_between_kills: float = 2.0,
    is_seeded: bool = False,
    heartbeat_interval: float = 1.0,
) -> ResumeReport:
    """Run the scenario (see the module docstring) and return its report."""
    report = ResumeReport(num_streams, seconds_between_kills=seconds_between_kills)
    with tempfile.TemporaryDirectory(prefix="resume-") as folder:
        deployment = Deployment(
            Path(folder), heartbeat_interval, num_threads=1, num_servers=3, dtype="float32"
        )
        timeout = httpx.Timeout(REQUEST_TIMEOUT_SECONDS, connect=5)
        limits = httpx.Limits(max_connections=num_streams + 8)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            try:
                await deployment.start_all(client)
                await _run(client, deployment, report, max_tokens, is_seeded, first_kill_after)
            finally:
                deployment.stop()
    return report


async def _run(
    client: httpx.AsyncClient,
    deployment: Deployment,
    report: ResumeReport,
    max_tokens: int,
    is_seeded: bool,
    first_kill_after: float,
) -> None:
    base = deployment.gateway_url
    bodies = [_body(i, max_tokens, is_seeded) for i in range(report.num_streams)]
    keys = sorted({json.dumps(b, sort_keys=True) for b in bodies})
    # The undisturbed answers, one request per distinct body.
    answers = await asyncio.gather(*(_stream(client, base, json.loads(k)) for k in keys))
    expected = dict(zip(keys, answers, strict=True))
    assert not any(v.startswith("error") or v == "hung" for v in expected.values()), expected

    async def killer() -> None:
        await asyncio.sleep(first_kill_after)
        deployment.kill("cb_0")
        await asyncio.sleep(report.seconds_between_kills)
        deployment.kill("cb_1")

    start = time.monotonic()
    killing = asyncio.create_task(killer())
    outcomes = await asyncio.gather(*(_stream(client, base, body) for body in bodies))
    await killing
    report.duration_seconds = round(time.monotonic() - start, 2)
    for body, text in zip(bodies, outcomes, strict=True):
        if text == "hung":
            report.num_hung += 1
        elif text.startswith("error"):
            report.num_errors += 1
            report.error_messages.append(text)
        elif text == expected[json.dumps(body, sort_keys=True)]:
            report.num_identical += 1
        else:
            report.num_different += 1
    report.error_messages = report.error_messages[:10]
    metrics = (await client.get(f"{base}/metrics")).text
    for cause in ("broken", "eof", "timeout", "marked_down"):
        count = int(metric_sum(metrics, "gateway_resumed_streams_total", cause=cause))
        if count:
            report.resumed_by_cause[cause] = count
    report.num_resumed = sum(report.resumed_by_cause.values())
    report.num_broken = int(
        metric_sum(metrics, "gateway_requests_total", outcome="upstream_broken")
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-streams", type=int, default=200, help="default: %(default)s")
    parser.add_argument("--max-tokens", type=int, default=48, help="default: %(default)s")
    parser.add_argument("--first-kill-after", type=float, default=2.0, help="seconds")
    parser.add_argument("--seconds-between-kills", type=float, default=2.0)
    seeded_help = "half the streams sample, seeded"
    parser.add_argument("--seeded", action="store_true", dest="is_seeded", help=seeded_help)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run and print the report; exit 1 if a stream was lost, wrong or hung."""
    options = vars(parse_args(argv))  # named as run_resume's parameters
    path = options.pop("json")
    report = asyncio.run(run_resume(**options))
    print_report(report, path)
    is_whole = report.num_identical == report.num_streams
    return 0 if is_whole else 1


if __name__ == "__main__":
    raise SystemExit(main())
