"""A real Triton Inference Server (PyTriton + transformers) answering Triton's generate API.

This is the server the gateway's Triton backends are tested against, so these tests pin down
what Triton itself answers: the JSON of ``generate``, the events of ``generate_stream``, the
error shape and the ready endpoints, and that :mod:`client.triton.protocol` (requests) and
:mod:`client.triton.responses` (answers) read and write them.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from client.triton.protocol import TritonGenerateRequest
from client.triton.responses import TritonErrorResponse, TritonGenerateResponse
from harness.waiting import wait_until
from protocol.generation import GenerateRequest
from tests.triton.stand_in.pytriton_server import WORKER_SCRIPT
from tests.triton.triton_server import TritonServer

pytestmark = pytest.mark.slow


def _events(response: httpx.Response) -> list[dict]:
    """The JSON payloads of a Server-Sent Events answer."""
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def test_ready_endpoints(triton: TritonServer) -> None:
    assert httpx.get(f"{triton.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{triton.url}/v2/health/ready").status_code == 200
    assert httpx.get(triton.model_url("ready")).status_code == 200
    missing = httpx.get(f"{triton.url}/v2/models/no-such-model/ready")
    assert missing.status_code == 400  # Triton's answer for an unknown model's readiness


def test_generate_greedy_answers_paris(triton: TritonServer, chat_prompt: str) -> None:
    body = {"text_input": chat_prompt, "max_tokens": 16}
    response = httpx.post(triton.model_url("generate"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    payload = response.json()
    assert set(payload) == {"model_name", "model_version", "text_output"}
    answer = TritonGenerateResponse.model_validate(payload)
    assert (answer.model_name, answer.model_version) == ("ensemble", "1")
    assert "Paris" in answer.text_output


def test_generate_stream_sends_deltas_that_add_up(triton: TritonServer, chat_prompt: str) -> None:
    body = {"text_input": chat_prompt, "max_tokens": 16}
    whole = httpx.post(triton.model_url("generate"), json=body, timeout=120).json()
    with httpx.stream(
        "POST", triton.model_url("generate_stream"), json={**body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert len(events) > 1  # one event per piece of text, no [DONE] marker
    pieces = [TritonGenerateResponse.model_validate(event) for event in events]
    assert "".join(p.text_output for p in pieces) == whole["text_output"]


def test_a_request_arriving_mid_stream_waits_its_turn(
    triton: TritonServer, chat_prompt: str
) -> None:
    """PyTriton runs every request on one event loop: a blocking callable used to deadlock here."""
    first_event = []

    def stream() -> str:
        body = {"text_input": chat_prompt, "max_tokens": 16, "stream": True}
        with httpx.stream("POST", triton.model_url("generate_stream"), json=body, timeout=60) as r:
            texts = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    texts.append(json.loads(line[6:])["text_output"])
                    first_event.append(True)
            return "".join(texts)

    def generate() -> str:
        body = {"text_input": chat_prompt, "max_tokens": 16}
        return httpx.post(triton.model_url("generate"), json=body, timeout=60).json()["text_output"]

    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream)
        # Until the stream is under way (or over: its result() then says why).
        wait_until(
            lambda: first_event or streamed.done(),
            60,
            interval=0.01,
            message="the stream's first event",
        )
        answered = pool.submit(generate)
        assert "Paris" in streamed.result(timeout=90)
        assert "Paris" in answered.result(timeout=90)


def test_round_trip_through_the_protocol(triton: TritonServer, chat_prompt: str) -> None:
    """A native request sent as Triton JSON; Triton's answer read back into texts."""
    native = GenerateRequest(
        prompt=chat_prompt, generation_config={"max_new_tokens": 16, "stop": [" Paris"]}
    )
    request = TritonGenerateRequest.from_generate_request(
        native, chat_prompt, default_max_tokens=64
    )
    response = httpx.post(triton.model_url("generate"), json=request.to_triton_json(), timeout=120)
    assert response.status_code == 200, response.text
    (text,) = TritonGenerateResponse.model_validate(response.json()).texts()
    assert text == "The capital of France is"  # cut before the stop word


def test_beam_search_returns_every_beam(triton: TritonServer, chat_prompt: str) -> None:
    body = {"text_input": chat_prompt, "max_tokens": 8, "beam_width": 2}
    response = httpx.post(triton.model_url("generate"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert len(TritonGenerateResponse.model_validate(response.json()).texts()) == 2


def test_errors_have_triton_shape(triton: TritonServer, chat_prompt: str) -> None:
    refused = httpx.post(
        triton.model_url("generate"), json={"text_input": chat_prompt, "max_tokens": 0}
    )
    assert refused.status_code == 400
    assert "max_tokens" in TritonErrorResponse.model_validate(refused.json()).error

    missing = httpx.post(triton.model_url("generate"), json={"text_input": chat_prompt})
    assert missing.status_code == 400
    assert "missing required input(s) ['max_tokens']" in missing.json()["error"]

    unknown = httpx.post(
        f"{triton.url}/v2/models/no-such-model/generate", json={"text_input": "x", "max_tokens": 1}
    )
    assert unknown.status_code == 404
    assert "unknown model" in unknown.json()["error"]

    # A streaming request refused before its first response: status 400, the error as an event.
    with httpx.stream(
        "POST",
        triton.model_url("generate_stream"),
        json={"text_input": chat_prompt, "max_tokens": 4, "presence_penalty": 0.5, "stream": True},
    ) as stream:
        assert stream.status_code == 400
        (event,) = _events(stream)
    assert "presence_penalty" in TritonErrorResponse.model_validate(event).error


class WorkerPipe:
    """``transformers_worker.py`` run directly: JSON lines in, replies read with a timeout."""

    def __init__(self, model_dir: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), "--model-dir", str(model_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def send(self, message: dict) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        self.process.stdin.flush()

    def reply(self, timeout: float = 60) -> dict:
        """The next reply; fails the test when none comes in ``timeout`` seconds."""
        reply = self._replies.get(timeout=timeout)
        assert reply is not None, "the worker closed its output"
        return reply

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()  # end of input: the worker exits by itself
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def test_worker_stops_a_cancelled_stream(default_model_path: Path) -> None:
    """What the server sends when PyTriton closes a request early: the worker stops at once.

    (A client disconnecting does not get this far: PyTriton 0.7 does not tell the callable.)
    """
    worker = WorkerPipe(default_model_path)
    try:
        assert worker.reply(timeout=120)["ready"]
        long = {"max_new_tokens": 300, "generate_kwargs": {"min_new_tokens": 300}}
        worker.send({"op": "generate", "id": 1, "text": "Once upon a time", "stream": True, **long})
        assert "delta" in worker.reply()
        started = time.monotonic()
        worker.send({"op": "cancel", "id": 1})
        while "done" not in (reply := worker.reply(timeout=30)):
            assert reply["id"] == 1 and "delta" in reply  # sent before the cancel arrived
        assert reply == {"id": 1, "done": True, "texts": []}
        assert time.monotonic() - started < 5  # far from 300 tokens' worth of CPU

        worker.send({"op": "generate", "id": 2, "text": "Hi", "max_new_tokens": "x"})
        assert worker.reply()["error"].startswith("ValueError: ")
        worker.send(
            {"op": "generate", "id": 3, "text": "The capital of France is", "max_new_tokens": 4}
        )
        reply = worker.reply()
        assert reply["id"] == 3 and reply["done"] and len(reply["texts"]) == 1
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_a_killed_worker_fails_the_stream_then_is_replaced(
    triton: TritonServer, chat_prompt: str
) -> None:
    """Worker death is a Triton error for the request in flight (not a hang); the next request
    gets a new worker. Last in this module: it replaces the worker the others used."""
    pid = triton.worker_pid()
    assert pid is not None, triton.log_tail()
    # min_length keeps the model from ending early: the stream is still running when killed.
    body = {"text_input": chat_prompt, "max_tokens": 400, "min_length": 400, "stream": True}
    events = []
    started = time.monotonic()
    with httpx.stream("POST", triton.model_url("generate_stream"), json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - started < 30  # ended by the kill, not by 400 tokens or a timeout
    assert "text_output" in events[0]
    error = TritonErrorResponse.model_validate(events[-1]).error
    assert "model worker exited with code -9" in error

    body = {"text_input": chat_prompt, "max_tokens": 16}
    response = httpx.post(triton.model_url("generate"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["text_output"]
    assert triton.worker_pid() not in (None, pid)
