"""Mid-stream resume (``client.forwarding.resume``): the tracker's bookkeeping on split and
broken events, and real CB servers SIGKILLed under a load of 200 streams (greedy and seeded)
whose every answer still arrives whole and identical to the undisturbed one; a request whose
servers die as soon as they take it is resumed once, not onto every server in turn."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.resume_under_fire import run_resume
from client.forwarding.stream_tokens import StreamTokens, num_choices_of
from harness.processes import Deployment
from harness.waiting import metric_sum

OPENING = b': stream {"id":"cmpl-1","created":7,"prompt_token_ids":[5,6,7]}\n\n'


def _event(tokens: dict[str, list[object]], data: dict[str, object]) -> bytes:
    return b": tokens " + json.dumps(tokens).encode() + b"\ndata: " + json.dumps(data).encode()


def test_the_tracker_counts_what_the_caller_got_and_strips_its_lines() -> None:
    tracker = StreamTokens()
    first = _event(
        {"0": [[11, 12], 5], "1": [[21], 0]},
        {"choices": [{"index": 0, "text": "Hello", "finish_reason": None}]},
    )
    second = _event(
        {"1": [[22], 3]}, {"choices": [{"index": 1, "text": "abc", "finish_reason": "length"}]}
    )
    cut_off = b': tokens {"0": [[13], 2]}\ndata: {"cho'
    stream = OPENING + first + b"\n\n" + second + b"\n\n" + cut_off
    out = b""
    for i in range(0, len(stream), 7):  # the bytes arrive in pieces
        out += tracker.feed(stream[i : i + 7])
    assert b": tokens" not in out and b": stream" not in out
    assert out.count(b"\n\n") == 2 and out.startswith(b"data: {")
    assert tracker.is_resumable and tracker.prompt_token_ids == [5, 6, 7]
    assert tracker.choices[0].token_ids == [11, 12] and tracker.choices[0].num_text_chars == 5
    assert tracker.choices[1].is_finished and not tracker.choices[0].is_finished
    tracker.switch()  # the cut-off event of the dead server is not counted
    body = json.loads(tracker.resume_body(b'{"prompt": "x", "n": 2, "stream": true}', 2))
    assert body["prompt"] == "x" and body["n"] == 2
    assert body["resume"] == {
        "response_id": "cmpl-1",
        "created": 7,
        "prompt_token_ids": [5, 6, 7],
        "choices": [{"index": 0, "token_ids": [11, 12], "num_text_chars": 5}],
        "num_completion_tokens": 4,
    }
    # Events without comment lines pass as they are; a chunk whose text reads like the
    # closing event does not end the stream.
    looks_done = b'data: {"choices":[{"index":0,"text":"data: [DONE]","finish_reason":null}]}'
    assert tracker.feed(looks_done + b"\n\n") == looks_done + b"\n\n"
    assert tracker.is_resumable
    assert tracker.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert not tracker.is_resumable
    assert num_choices_of(b'{"generation_config": {"num_return_sequences": 3}}') == 3


def test_two_of_three_servers_sigkilled_under_200_streams() -> None:
    """Every stream completes with the undisturbed text (half of them seeded samples), none
    sees an error, and broken streams were resumed."""
    report = asyncio.run(
        run_resume(num_streams=200, max_tokens=24, first_kill_after=1.5, is_seeded=True)
    )
    assert report.num_hung == 0 and report.num_errors == 0, (report, *report.error_messages)
    assert report.num_identical == 200, report
    assert report.num_resumed > 0 and set(report.resumed_by_cause) == {"broken"}, report


def test_a_request_that_kills_its_servers_at_once_is_resumed_once() -> None:
    """Each server taking the stream is SIGKILLed as soon as it is seen streaming: the first
    death (within a second of taking it) is resumed, the second such death ends the stream:
    the caller gets an error event instead of a second resume."""
    asyncio.run(_poison_scenario())


async def _poison_scenario() -> None:
    with tempfile.TemporaryDirectory(prefix="poison-") as folder:
        deployment = Deployment(Path(folder), 1.0, num_threads=1, num_servers=3)
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(120, connect=5), trust_env=False
        ) as client:
            try:
                await deployment.start_all(client)
                # A cold server's first forward is slow: warm each one, so that "dies within a
                # second of taking the request" holds for the kills below, as it would for a
                # request that kills its server.
                warm = {"prompt": "Hi", "max_tokens": 2}
                for index in range(3):
                    url = f"{deployment.server_url(index)}/v1/completions"
                    assert (await client.post(url, json=warm)).status_code == 200
                await _kill_every_taker(client, deployment)
            finally:
                deployment.stop()


async def _kill_every_taker(client: httpx.AsyncClient, deployment: Deployment) -> None:
    base = deployment.gateway_url
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    names = {deployment.server_url(i): f"cb_{i}" for i in range(3)}
    killed: list[str] = []
    events: list[str] = []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if '"error"' in line:
                break
            if len(killed) == 3:
                continue
            rows = (await client.get(f"{base}/backends")).json()["backends"]
            busy = [r["url"] for r in rows if r["num_in_flight"] and r["url"] not in killed]
            if busy:  # the server streaming now: it dies at once
                killed.append(busy[0])
                deployment.kill(names[busy[0]])
                started = time.monotonic()
    assert time.monotonic() - started < 60
    log = (deployment.folder / "gateway.log").read_text(errors="replace")[-3000:]
    # A server killed before its first chunk of the continuation is a plain failover inside
    # the one resume (then a third server streams); either way one resume, then the error.
    assert 2 <= len(killed) <= 3, (killed, log)
    assert '"error"' in events[-1], (events[-3:], log)
    assert "not resumed (1 resumes, two servers died at once taking it)" in log, log
    metrics = (await client.get(f"{base}/metrics")).text
    assert metric_sum(metrics, "gateway_resumed_streams_total") == 1, log
