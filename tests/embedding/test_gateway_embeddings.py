"""``POST /v1/embeddings`` on the gateway: the openai SDK through it to a real embedding
server, routing by model beside a chat server, 400s at intake, and the other kinds that may
embed (a jumper, an OpenAI-compatible engine) forwarding the request as sent."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from tests.embedding.conftest import MODEL
from tests.support.openai_facade import FacadeSettings, start_facade


def test_openai_sdk_embeddings_through_the_gateway(embedding_gateway: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{embedding_gateway.url}/v1", api_key="x", max_retries=0)
    answer = client.embeddings.create(
        model=MODEL, input=["The cat sits on the mat.", "A cat is sitting on a mat."]
    )
    first, second = answer.data[0].embedding, answer.data[1].embedding
    similarity = sum(a * b for a, b in zip(first, second, strict=True))
    print(
        f"SDK embeddings through the gateway: model={answer.model} n={len(answer.data)} "
        f"dim={len(first)} first[:4]={[round(v, 4) for v in first[:4]]} "
        f"cos(0,1)={similarity:.4f} usage={answer.usage}"
    )
    assert answer.model == MODEL and len(first) == 384
    assert similarity > 0.8 and answer.usage.prompt_tokens > 0
    # The SDK asks for base64 by default when numpy is there, and decodes it itself; floats too.
    floats = client.embeddings.create(model=MODEL, input="hi", encoding_format="float")
    assert len(floats.data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=MODEL, input="hi", dimensions=64)
    client.close()


def test_bad_bodies_are_refused_at_the_gateway(embedding_gateway: ServerThread) -> None:
    for body in ({"model": MODEL, "input": []}, {"model": MODEL}, {"input": [[1], "a"]}):
        answer = embedding_gateway.http.post("/v1/embeddings", json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"].startswith("input"), answer.text
    answer = embedding_gateway.http.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert answer.status_code == 404 and MODEL in answer.text


def test_embeddings_and_chats_are_routed_by_model(
    tmp_path: Path, embedding_server: ServerThread
) -> None:
    chat = FakeServerSettings(model_id="chat-model", name="C", kind="continuous_batching")
    chat_server = start_fake_server(chat)
    gateway = start_gateway(
        tmp_path,
        continuous_batching_server_urls=[chat_server.url],
        embedding_server_urls=[embedding_server.url],
    )
    try:
        embedded = gateway.http.post("/v1/embeddings", json={"model": MODEL, "input": "a"})
        assert embedded.status_code == 200, embedded.text
        anonymous = gateway.http.post("/v1/embeddings", json={"input": "a"})
        assert anonymous.status_code == 200, anonymous.text  # only the embedding server embeds
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        answer = gateway.http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 503 and "do not answer" in answer.text, answer.text
        assert chat.requests == []
        models = [m["id"] for m in gateway.http.get("/v1/models").json()["data"]]
        assert models == ["chat-model", MODEL]
    finally:
        stop_all(gateway, chat_server)


def test_jumpers_and_engines_forward_embeddings(
    tmp_path: Path, embedding_server: ServerThread
) -> None:
    """A jumper whose upstream is the embedding server (model_map renames the model), and an
    engine that is the embedding server behind the OpenAI-only facade."""
    facade_settings = FacadeSettings(embedding_server.url)
    facade = start_facade(facade_settings)
    jumper = {
        "api_key": "sk-real-looking",
        "base_url": f"{embedding_server.url}/v1",
        "model_map": {"text-embedding-3-small": MODEL},
    }
    gateway = start_gateway(
        tmp_path,
        openai_jumper_configs=[jumper],
        openai_compatible_server_urls=[{"url": facade.url}],
    )
    try:
        upstream = gateway.http.post(
            "/v1/embeddings",
            json={"model": "text-embedding-3-small", "input": "a"},
            headers={"X-LLM-Route": "openai"},
        )
        assert upstream.status_code == 200, upstream.text
        assert len(upstream.json()["data"][0]["embedding"]) == 384
        engine = gateway.http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]})
        assert engine.status_code == 200 and len(engine.json()["data"]) == 2, engine.text
        assert facade_settings.paths.count("/v1/embeddings") == 1
    finally:
        stop_all(gateway, facade)
