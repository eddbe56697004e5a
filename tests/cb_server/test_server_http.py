"""The HTTP layer of a real CB server: X-Request-ID echoed (streams too) or generated and in the
log line; the request models in /openapi.json."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from harness.servers import ServerThread
from harness.waiting import wait_until
from tests.support.default_model import chat_body
from utils.request_id import REQUEST_ID_HEADER, sane_request_id

LOGGER = "server.common.request_context"
GENERATED_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def log_lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def finish_line(caplog: pytest.LogCaptureFixture, request_id: str) -> str:
    """The request's closing log line; it is written just after the answer's last byte."""

    def line() -> str | None:
        for record in list(caplog.records):
            message = record.getMessage()
            if record.name == LOGGER and message.startswith(f"request_id={request_id} "):
                return message
        return None

    return wait_until(line, 10, message=f"the log line of request {request_id}")


def test_request_id_is_echoed_and_logged(cb_server: ServerThread, log_lines) -> None:
    body = {"prompt": "The capital of France is", "generation_config": {"max_new_tokens": 4}}
    response = httpx.post(
        f"{cb_server.url}/generate", json=body, headers={REQUEST_ID_HEADER: "gw-42"}, timeout=60
    )
    assert response.status_code == 200 and response.headers[REQUEST_ID_HEADER] == "gw-42"
    answer = response.json()
    usage, choice = answer["usage"], answer["choices"][0]
    line = finish_line(log_lines, "gw-42")
    assert "endpoint=/generate status=200" in line and f"id={answer['id']}" in line
    assert f"prompt_tokens={usage['prompt_tokens']}" in line
    assert f"completion_tokens={usage['completion_tokens']}" in line
    assert f"finish={choice['finish_reason']}" in line and "error=" not in line


def test_stream_answers_carry_the_request_id(cb_server: ServerThread, log_lines) -> None:
    body = chat_body("Say hi.", max_tokens=3, n=2, temperature=0.7, stream=True)
    with httpx.stream(
        "POST",
        f"{cb_server.url}/v1/chat/completions",
        json=body,
        headers={REQUEST_ID_HEADER: "stream-1"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers[REQUEST_ID_HEADER] == "stream-1"
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    line = finish_line(log_lines, "stream-1")
    assert "endpoint=/v1/chat/completions status=200" in line
    assert re.search(r"finish=(stop|length),(stop|length) ", line)


@pytest.mark.parametrize("sent", [None, "x" * 129, b"tab\there", b"caf\xc3\xa9"])
def test_missing_or_unusable_ids_are_replaced(
    cb_server: ServerThread, sent: str | bytes | None
) -> None:
    headers = {} if sent is None else {REQUEST_ID_HEADER: sent}
    ids = []
    for _ in range(2):
        response = httpx.get(f"{cb_server.url}/health", headers=headers, timeout=10)
        assert response.status_code == 200
        ids.append(response.headers[REQUEST_ID_HEADER])
    assert all(GENERATED_ID.fullmatch(i) for i in ids) and ids[0] != ids[1]


def test_refused_request_logs_its_error(cb_server: ServerThread, log_lines) -> None:
    body = {"prompt": "x", "generation_config": {"temperature": -1}}
    response = httpx.post(
        f"{cb_server.url}/generate", json=body, headers={REQUEST_ID_HEADER: "bad-1"}, timeout=60
    )
    assert response.status_code == 400 and response.headers[REQUEST_ID_HEADER] == "bad-1"
    line = finish_line(log_lines, "bad-1")
    assert "status=400" in line and "generation_config.temperature" in line


def test_sane_request_id() -> None:
    assert sane_request_id("abc-123_XYZ:7") == "abc-123_XYZ:7"
    assert sane_request_id("x" * 128) == "x" * 128
    for bad in (None, "", "   ", "x" * 129, "line\nbreak", "caf\u00e9"):
        assert sane_request_id(bad) is None


def test_openapi_documents_the_request_models(cb_server: ServerThread) -> None:
    schema = httpx.get(f"{cb_server.url}/openapi.json", timeout=10).json()
    components = schema["components"]["schemas"]
    for path, model in (
        ("/generate", "GenerateRequest"),
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert components[model]["type"] == "object"
    assert "generation_config" in components["GenerateRequest"]["properties"]
