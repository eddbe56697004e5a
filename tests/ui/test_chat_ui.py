"""The chat front end (``chat_ui_app.py``) and its gateway client (``chat_ui/gateway_client.py``).

The page runs under Streamlit's AppTest (the script in this process, no browser) against a real
gateway in front of a real static-batching server with the default model: the ``sb_gateway``
fixture. The real browser test is ``test_chat_ui_browser.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("streamlit", reason="the chat UI needs the 'ui' extra (pip install -e .[ui])")

from streamlit.testing.v1 import AppTest  # noqa: E402

from chat_ui.gateway_client import (  # noqa: E402
    DEFAULT_GATEWAY_URL,
    GATEWAY_URL_ENV,
    ChatClient,
    ChatStats,
    Decoding,
    GatewayError,
    Usage,
    api_messages,
    gateway_url_from,
)
from harness.servers import ServerThread, reserve_socket, start_gateway, url_of  # noqa: E402
from tests.support.default_model import MODEL_ID  # noqa: E402
from tests.support.paths import REPO_ROOT  # noqa: E402

APP_FILE = str(REPO_ROOT / "chat_ui_app.py")
QUESTION = "What is the capital of France?"
#: Short answers keep the tests fast; the greedy answer to QUESTION is 8 tokens.
MAX_TOKENS = 24


@pytest.fixture
def dead_url() -> Iterator[str]:
    """The address of a port that refuses connections (bound, never listening)."""
    with reserve_socket() as sock:
        yield url_of(sock)


def open_page(monkeypatch: pytest.MonkeyPatch, gateway_url: str) -> AppTest:
    """The page, run once, talking to ``gateway_url`` (through the environment variable)."""
    monkeypatch.setenv(GATEWAY_URL_ENV, gateway_url)
    page = AppTest.from_file(APP_FILE, default_timeout=120).run()
    assert not page.exception, page.exception
    return page


def ask(page: AppTest, question: str, max_tokens: int = MAX_TOKENS) -> None:
    """Type ``question`` into the chat box and let the page answer it."""
    page.sidebar.number_input(key="max_tokens").set_value(max_tokens)
    page.chat_input[0].set_value(question).run()
    assert not page.exception, page.exception


def transcript(page: AppTest) -> list[tuple[str, str, str, str]]:
    """(role, text, stats caption, error) of each chat message on the page."""
    rows = []
    for message in page.chat_message:
        text = "".join(m.value for m in message.markdown)
        caption = " ".join(c.value for c in message.caption)
        error = " ".join(e.value for e in message.error)
        rows.append((message.name, text, caption, error))
    return rows


# ----------------------------------------------------------------------------- the client alone


def test_gateway_url_precedence() -> None:
    env = {GATEWAY_URL_ENV: "http://env:1"}
    assert gateway_url_from(["--gateway-url", "http://arg:2"], env) == "http://arg:2"
    assert gateway_url_from(["-q", "tests/x.py", "--gateway", "no"], env) == "http://env:1"
    assert gateway_url_from([], {}) == DEFAULT_GATEWAY_URL


def test_api_messages_leave_out_failed_exchanges() -> None:
    history = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "answer one", "stats": "..."},
        {"role": "user", "content": "refused"},
        {"role": "assistant", "content": "", "error": "HTTP 400"},
        {"role": "user", "content": "two"},
    ]
    assert api_messages(history) == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "two"},
    ]


def test_stats_summary() -> None:
    stats = ChatStats(
        0.25, 2.0, Usage(prompt_tokens=37, completion_tokens=8, total_tokens=45), "length", "greedy"
    )
    assert stats.tokens_per_second == 4.0
    summary = stats.summary()
    for part in ("time to first token 0.25 s", "4.0 tokens/s", "37 prompt + 8 completion = 45"):
        assert part in summary
    assert "stopped at max tokens" in summary
    assert "token usage not reported" in ChatStats(None, 1.0, None, "stop", "greedy").summary()


def test_client_against_real_gateway(sb_gateway: ServerThread, dead_url: str) -> None:
    with ChatClient(sb_gateway.url) as client:
        assert client.list_models() == [MODEL_ID]
        stream = client.chat(
            MODEL_ID, [{"role": "user", "content": QUESTION}], Decoding(max_tokens=MAX_TOKENS)
        )
        pieces = list(stream)
        assert len(pieces) > 1  # streamed, not one block
        assert "".join(pieces) == stream.text == "The capital of France is Paris."
        assert stream.stats is not None and stream.stats.usage is not None
        assert stream.stats.usage.completion_tokens == 8
        assert stream.stats.finish_reason == "stop"

        with pytest.raises(GatewayError, match=r"The gateway refused .*\(HTTP 404\)") as refused:
            list(client.chat("no-such-model", [{"role": "user", "content": "hi"}], Decoding()))
        assert refused.value.status_code == 404
        assert "refused" in refused.value.message and MODEL_ID in refused.value.message

    with (
        ChatClient(dead_url) as client,
        pytest.raises(GatewayError, match="Cannot reach the gateway at") as down,
    ):
        client.list_models()
    assert down.value.status_code is None
    assert f"Cannot reach the gateway at {dead_url}" in down.value.message


def test_error_event_in_the_middle_of_a_stream() -> None:
    """An ``{"error": ...}`` event after some text (a backend lost mid-answer) is readable."""
    events = [
        {"choices": [{"index": 0, "delta": {"content": "The capital"}}]},
        {"error": {"type": "upstream_error", "message": "backend went away", "code": 502}},
    ]
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    with ChatClient("http://gateway.test", transport=httpx.MockTransport(handler)) as client:
        stream = client.chat("m", [{"role": "user", "content": "hi"}], Decoding())
        with pytest.raises(GatewayError, match="The answer broke off: backend went away"):
            list(stream)
    assert stream.text == "The capital" and stream.stats is None


# ----------------------------------------------------------------------------- the page


def test_models_listed_and_greedy_answer_with_stats(
    monkeypatch: pytest.MonkeyPatch, sb_gateway: ServerThread
) -> None:
    page = open_page(monkeypatch, sb_gateway.url)
    assert page.sidebar.selectbox(key="model").options == [MODEL_ID]
    assert page.sidebar.radio(key="decoding").value == "greedy"
    assert not page.error
    ask(page, QUESTION)
    rows = transcript(page)
    assert [r[0] for r in rows] == ["user", "assistant"]
    assert rows[0][1] == QUESTION
    role, text, caption, error = rows[1]
    assert text == "The capital of France is Paris." and not error
    assert "time to first token" in caption and "tokens/s" in caption
    assert "prompt + 8 completion" in caption and "greedy" in caption
    # The conversation is kept: a follow-up question sees the whole exchange.
    ask(page, "And what is the capital of Germany?")
    rows = transcript(page)
    assert len(rows) == 4 and "Berlin" in rows[3][1], rows
    assert len(page.session_state["history"]) == 4


def test_sampling_answer(monkeypatch: pytest.MonkeyPatch, sb_gateway: ServerThread) -> None:
    page = open_page(monkeypatch, sb_gateway.url)
    page.sidebar.radio(key="decoding").set_value("sampling").run()
    page.sidebar.slider(key="temperature").set_value(0.5)
    page.sidebar.slider(key="top_p").set_value(0.8)
    ask(page, QUESTION)
    _, text, caption, error = transcript(page)[-1]
    assert text and not error
    assert "sampling (T=0.5, top_p=0.8)" in caption


def test_beam_search_answer(monkeypatch: pytest.MonkeyPatch, sb_gateway: ServerThread) -> None:
    page = open_page(monkeypatch, sb_gateway.url)
    page.sidebar.radio(key="decoding").set_value("beam_search").run()
    page.sidebar.slider(key="num_beams").set_value(3)
    ask(page, QUESTION)
    _, text, caption, error = transcript(page)[-1]
    assert "Paris" in text and not error
    assert "beam search (3 beams)" in caption and "completion =" in caption


def test_refusal_is_readable_and_left_out_of_the_conversation(
    monkeypatch: pytest.MonkeyPatch, sb_gateway: ServerThread
) -> None:
    page = open_page(monkeypatch, sb_gateway.url)
    # More new tokens than the model's context holds: the gateway answers 400.
    ask(page, QUESTION, max_tokens=8192)
    _, text, caption, error = transcript(page)[-1]
    assert not text and not caption
    assert error.startswith("The gateway refused the chat request (HTTP 400):"), error
    assert "exceeds this model's context" in error
    # The refused question is not sent again with the next one.
    ask(page, QUESTION)
    _, text, _, error = transcript(page)[-1]
    assert text == "The capital of France is Paris." and not error


def test_gateway_down_at_start(monkeypatch: pytest.MonkeyPatch, dead_url: str) -> None:
    page = open_page(monkeypatch, dead_url)
    assert [e.value for e in page.error] == [
        f"Cannot reach the gateway at {dead_url}: is it running? "
        "Start it with `python start_app.py up`."
    ]
    assert page.chat_input[0].disabled
    assert not page.sidebar.selectbox


def test_gateway_going_down_mid_conversation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sb_server: ServerThread
) -> None:
    gateway = start_gateway(tmp_path, static_batching_server_urls=[sb_server.url])
    try:
        page = open_page(monkeypatch, gateway.url)
        assert page.sidebar.selectbox(key="model").options == [MODEL_ID]
    finally:
        gateway.stop()
    ask(page, QUESTION)
    _, text, _, error = transcript(page)[-1]
    assert not text
    assert error.startswith(f"Cannot reach the gateway at {gateway.url}"), error
