"""The official ``openai`` SDK, unchanged, against the gateway."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import start_gateway, stop_all

MESSAGES = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, list[str]]]:
    """An SDK client on the gateway over two fake servers, and the expected answer texts."""
    settings_a = FakeServerSettings(model_id="model-a", name="A", num_stream_events=4)
    settings_b = FakeServerSettings(model_id="model-b", name="B")
    server_a, server_b = start_fake_server(settings_a), start_fake_server(settings_b)
    gateway = start_gateway(tmp_path_factory.mktemp("sdk"), [server_a.url, server_b.url])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=5)
    yield client, [settings_a.text(), settings_b.text()]
    client.close()
    stop_all(gateway, server_a, server_b)


def test_chat_completion(sdk: tuple[openai.OpenAI, list[str]]) -> None:
    client, texts = sdk
    for model, text in zip(("model-a", "model-b"), texts, strict=True):
        completion = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
        assert completion.model == model
        assert completion.choices[0].message.content == text
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.total_tokens > 0


def test_chat_completion_stream(sdk: tuple[openai.OpenAI, list[str]]) -> None:
    client, texts = sdk
    stream = client.chat.completions.create(
        model="model-a", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices]
    assert len(deltas) == 4
    assert "".join(d or "" for d in deltas) == texts[0]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_completion(sdk: tuple[openai.OpenAI, list[str]]) -> None:
    client, texts = sdk
    completion = client.completions.create(model="model-b", prompt="Once upon", max_tokens=4)
    assert completion.choices[0].text == texts[1]
    stream = client.completions.create(model="model-a", prompt="Once upon", stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == texts[0]


def test_models_list(sdk: tuple[openai.OpenAI, list[str]]) -> None:
    client, _ = sdk
    assert [model.id for model in client.models.list()] == ["model-a", "model-b"]


def test_errors_reach_the_sdk_as_typed_exceptions(sdk: tuple[openai.OpenAI, list[str]]) -> None:
    client, _ = sdk
    with pytest.raises(openai.NotFoundError, match="gpt-unknown") as not_found:
        client.chat.completions.create(model="gpt-unknown", messages=MESSAGES)
    assert "gpt-unknown" in not_found.value.message
    with pytest.raises(openai.BadRequestError, match="max_tokens") as bad:
        client.chat.completions.create(model="model-a", messages=MESSAGES, max_tokens=0)
    assert "max_tokens" in bad.value.message
