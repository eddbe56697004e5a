"""Probe a running gateway + CB server as a clumsy or hostile client would (issue #15) and
count, per kind of probe: cases, correct answers, 5xx, hangs, collateral failures (a normal
request failing or answering differently, KV blocks not freed) and secrets found.

Start the deployment first (``benchmarks/probe_deploy.sh up REPO RUN_DIR``), then::

    .venv/bin/python -m benchmarks.probe_bad_clients --run-dir RUN_DIR

Kept cheap for a shared 2-core machine: short prompts, a few new tokens, about 1.5 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks.probe_cases import Case, Tally, auth_cases, bad_request_cases
from benchmarks.probe_load import (
    Canary,
    abandoned_streams,
    complete,
    overload,
    silent_wrong_answer,
)
from benchmarks.probe_slow import hold_slow_clients

CALLER_KEY = "probe-caller-key-5b1f"
SECRETS = ("sk-probe-SECRET-7d3e9a51c0ffee", CALLER_KEY)
ANSWER_TIMEOUT = 20.0


async def send_raw(
    url: str, raw: bytes, timeout: float = ANSWER_TIMEOUT
) -> tuple[int | None, bytes]:
    """Send ``raw`` and read until the server closes; (status or 0 without an answer, or
    None when nothing came within ``timeout``; the whole answer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    data = b""
    try:
        writer.write(raw)
        try:
            await asyncio.wait_for(writer.drain(), timeout)
        except (ConnectionError, TimeoutError):
            pass  # answered and closed before the upload ended: read what it said
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        if not data:
            return None, b""
    except ConnectionError:
        pass
    finally:
        writer.close()
    if not data.startswith(b"HTTP/"):
        return 0, data
    return int(data.split(b" ", 2)[1]), data


def error_shaped(answer: bytes) -> bool:
    """A JSON body with an ``error`` (ours: an object; Triton's: a string)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        return "error" in json.loads(body) and b"application/json" in head.lower()
    except ValueError:
        return False


async def run_cases(
    cases: list[Case], urls: dict[str, str], tally: Tally, seen: list[bytes]
) -> None:
    """Each case once, in turn; 4xx answers must be in the error shape to count as correct."""
    for case in cases:
        status, answer = await send_raw(urls[case.target], case.raw)
        seen.append(answer)
        ok = status in case.expected and (
            status is not None and status < 400 or error_shaped(answer)
        )
        tally.add(case.name, status, ok)


async def secrets_check(
    urls: dict[str, str], run_dir: Path | None, seen: list[bytes], tally: Tally
) -> None:
    """Look for the jumper's and the callers' key in every answer seen, in what an upstream
    failure answers, in /backends, /metrics and /health, and in the apps' logs."""
    gateway = urls["gateway"]
    extra = [
        ("POST", "/v1/chat/completions", {"X-LLM-Route": "openai"}),
        ("GET", "/backends", {}),
        ("GET", "/metrics", {}),
        ("GET", "/health", {}),
    ]
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as http:
        for method, path, headers in extra:
            body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "a"}]}
            response = await http.request(
                method,
                path,
                headers={"Authorization": f"Bearer {CALLER_KEY}", **headers},
                json=body if method == "POST" else None,
            )
            seen.append(f"{response.headers}".encode() + response.content)
    places = list(seen)
    if run_dir is not None:
        places += [path.read_bytes() for path in sorted((run_dir / "logs").glob("*.log"))]
    for place in places:
        tally.cases += 1
        # The caller key is in our own requests' bytes: only answers and logs count.
        found = any(secret.encode() in place for secret in SECRETS)
        tally.correct += not found
        tally.secrets += found


async def probe(args: argparse.Namespace) -> list[Tally]:
    """Every kind of probe in turn, the canary after each; the tallies in order."""
    urls = {"gateway": args.gateway, "server": args.server}
    seen: list[bytes] = []
    headers = {"Authorization": f"Bearer {CALLER_KEY}"}
    async with httpx.AsyncClient(base_url=args.gateway, headers=headers, timeout=60) as http:
        canary = Canary(http)
        bad, auth = Tally("bad requests"), Tally("auth")
        slow, over = Tally("slow and idle clients"), Tally("overload")
        streams, secrets = Tally("abandoned streams"), Tally("secrets")
        await canary.check(bad)
        await run_cases(bad_request_cases(CALLER_KEY), urls, bad, seen)
        await silent_wrong_answer(http, bad)
        await canary.check(bad)
        await run_cases(auth_cases(CALLER_KEY), urls, auth, seen)
        await canary.check(auth)

        async def served() -> tuple[bool, float]:
            started = time.monotonic()
            status, _ = await complete(http, "Say hi.", max_tokens=4)
            return status == 200, time.monotonic() - started

        await hold_slow_clients(
            urls,
            CALLER_KEY,
            slow,
            served,
            hold_seconds=args.hold_seconds,
            num_idle=args.num_idle,
            num_slow=args.num_slow,
        )
        await canary.check(slow)
        await overload(http, args.server, over, args.overload)
        await canary.check(over)
        await abandoned_streams(http, args.server, streams, args.streams)
        await canary.check(streams)
    await secrets_check(urls, args.run_dir, seen, secrets)
    return [bad, auth, slow, over, streams, secrets]


def table(tallies: list[Tally]) -> str:
    """The counts as a markdown table, with a total row."""
    total = Tally("total")
    for tally in tallies:
        for name in ("cases", "correct", "server_errors", "hangs", "collateral", "secrets"):
            setattr(total, name, getattr(total, name) + getattr(tally, name))
    rows = [
        "| probe | cases | correct | 5xx | hangs | collateral failures | secrets found |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in [*tallies, total]:
        rows.append(
            f"| {t.kind} | {t.cases} | {t.correct} | {t.server_errors} | {t.hangs} | "
            f"{t.collateral} | {t.secrets} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the probes and print the table (and what failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:18400")
    parser.add_argument("--server", default="http://127.0.0.1:18401", help="the CB server")
    parser.add_argument("--run-dir", type=Path, help="the deployment's run folder (its logs)")
    hold_help = "how long slow clients are held before they count as hangs"
    parser.add_argument("--hold-seconds", type=float, default=40.0, help=hold_help)
    parser.add_argument("--num-idle", type=int, default=50, help="idle connections per app")
    slow_help = "byte-a-second header and body clients per app (each)"
    parser.add_argument("--num-slow", type=int, default=3, help=slow_help)
    parser.add_argument("--overload", type=int, default=100, help="concurrent requests")
    parser.add_argument("--streams", type=int, default=30, help="streams, 40%% abandoned")
    parser.add_argument("--json", type=Path, help="write the tallies here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    tallies = asyncio.run(probe(args))
    print(table(tallies))
    for tally in tallies:
        # Identical lines once, with their count (100 idle connections say the same).
        for line in dict.fromkeys(tally.notes + tally.failures):
            count = (tally.notes + tally.failures).count(line)
            print(f"  {tally.kind}: {line}" + (f" (x{count})" if count > 1 else ""))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in tallies], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
