"""The gateway refuses nothing a backend can do: it reads only what it routes on and forwards
the body as it came; each backend kind decides what it can take (issue #25, item 5)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from client.backends.plan_memo import PlanMemo
from client.balancing.policies import LeastOutstandingWork
from client.balancing.registry import BackendRegistry
from client.balancing.router import Router
from client.config.kinds import backends_from_config
from client.config.schema import ClientConfig
from client.gateway_request import GatewayRequest
from client.routing_fields import RoutingFields
from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import ServerThread, start_gateway, stop_all
from utils.errors import APIError

#: A chat with fields the gateway does not route by (tools, logprobs, ...), and one nobody knows.
TOOLS_CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    "tool_choice": "auto",
    "logprobs": True,
    "top_logprobs": 3,
    "response_format": {"type": "json_object"},
    "presence_penalty": 0.5,
    "logit_bias": {"42": -100},
    "some_future_field": {"nested": [1, 2]},
}
#: The same with a value our protocol refuses (top_logprobs beyond OpenAI's 0..20).
REFUSED_CHAT: dict[str, Any] = {**TOOLS_CHAT, "top_logprobs": 21}


@pytest.fixture(params=["first", "fallback"])
def upstream_gateway(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ServerThread, FakeServerSettings]]:
    """A gateway whose only backend is an OpenAI-compatible upstream that takes any field: an
    engine (first tier) or a jumper account (fallback tier)."""
    settings = FakeServerSettings(model_id="m", name="U", is_validating=False)
    server = start_fake_server(settings)
    entry = {"url": server.url, "tier": request.param, "api_key": "sk-upstream-0123456789"}
    gateway = start_gateway(tmp_path, openai_compatible_server_urls=[entry])
    yield gateway, settings
    stop_all(gateway, server)


def test_an_upstream_gets_tools_logprobs_and_unknown_fields_untouched(
    upstream_gateway: tuple[ServerThread, FakeServerSettings],
) -> None:
    gateway, settings = upstream_gateway
    body = json.dumps(TOOLS_CHAT).encode()
    answer = gateway.http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 200, answer.text
    path, received = settings.requests[-1]
    assert path == "/v1/chat/completions" and received == TOOLS_CHAT
    # The same through the openai SDK, streamed and not (tools as the SDK sends them).
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=5)
    tools = TOOLS_CHAT["tools"]
    for stream in (False, True):
        result = client.chat.completions.create(
            model="m",
            messages=TOOLS_CHAT["messages"],
            tools=tools,
            tool_choice="required",
            logprobs=True,
            top_logprobs=2,
            stream=stream,
        )
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in result if c.choices)
        else:
            assert result.choices[0].message.content
        sent = settings.requests[-1][1]
        assert sent["tools"] == tools and sent["tool_choice"] == "required"
        assert sent["logprobs"] is True and sent["top_logprobs"] == 2
    client.close()


def test_our_servers_answer_for_themselves(tmp_path: Path) -> None:
    """A field our server refuses reaches it anyway, and its 400 reaches the caller."""
    settings = FakeServerSettings(model_id="m", name="A", kind="continuous_batching")
    server = start_fake_server(settings)
    gateway = start_gateway(tmp_path, continuous_batching_server_urls=[server.url])
    refusable = REFUSED_CHAT  # our servers refuse it; the gateway does not judge it
    try:
        answer = gateway.http.post("/v1/chat/completions", json=refusable)
        assert answer.status_code == 400, answer.text
        assert settings.requests[-1][1] == refusable  # forwarded as it came
        # Only the routing fields are the gateway's: a malformed one is refused at once.
        refused = gateway.http.post("/v1/chat/completions", json={**refusable, "model": 5})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
        assert len(settings.requests) == 1
    finally:
        stop_all(gateway, server)


def test_the_openapi_schema_still_documents_the_request_models(
    upstream_gateway: tuple[ServerThread, FakeServerSettings],
) -> None:
    gateway, _ = upstream_gateway
    schema = gateway.http.get("/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


def _request(body: dict[str, Any], endpoint: str = "/v1/chat/completions") -> GatewayRequest:
    raw = json.dumps(body).encode()
    return GatewayRequest(
        endpoint=endpoint, parsed=RoutingFields.model_validate_json(raw), body=raw
    )


async def test_kinds_that_translate_decline_what_they_cannot_read() -> None:
    """A Triton server needs the request's native meaning; an engine takes it as sent."""
    config = ClientConfig.model_validate(
        {
            "triton_server_urls": [{"url": "http://t:1", "models": {"m": "ensemble"}}],
            "openai_compatible_server_urls": [{"url": "http://vllm:1", "models": ["m"]}],
        }
    )
    triton, engine = backends_from_config(config)
    for backend in (triton, engine):  # as after a good heartbeat
        backend.health.is_healthy, backend.health.model_ids = True, ["m"]
    registry = BackendRegistry([triton, engine])
    tools = _request(REFUSED_CHAT)
    tools_plans = PlanMemo(tools)  # what the forwarding side keeps for one request
    assert registry.candidates(tools, plans=tools_plans) == [engine]
    refusal = tools_plans.plan(triton)
    assert refusal.error is not None and refusal.error.status_code == 400
    # With the engine gone, the caller gets the 400 that names the field, not a 503.
    engine.health.is_healthy = False
    router = Router(registry, LeastOutstandingWork())

    async def no_refresh() -> None:  # health is set by hand here, not by heartbeats
        return None

    registry.refresh_if_stale = no_refresh  # type: ignore[method-assign]
    with pytest.raises(APIError) as exc_info:
        await router.select(_request(REFUSED_CHAT))
    assert exc_info.value.status_code == 400
    # A body our protocol reads goes to the Triton server, translated.
    plain = _request({"model": "m", "prompt": "hi", "max_tokens": 3}, "/v1/completions")
    plain_plans = PlanMemo(plain)
    assert registry.candidates(plain, plans=plain_plans) == [triton]
    assert plain_plans.plan(triton).translation is not None


def test_only_our_servers_are_asked_to_tokenize() -> None:
    """``/tokenize`` and ``/detokenize`` go to our servers; an OpenAI-compatible engine, a
    Triton server and an embedding server each decline them by name."""
    config = ClientConfig.model_validate(
        {
            "continuous_batching_server_urls": ["http://cb:1"],
            "triton_server_urls": [{"url": "http://t:1", "models": {"m": "ensemble"}}],
            "openai_compatible_server_urls": [{"url": "http://vllm:1", "models": ["m"]}],
            "embedding_server_urls": ["http://emb:1"],
        }
    )
    backends = backends_from_config(config)
    for backend in backends:
        backend.health.is_healthy, backend.health.model_ids = True, ["m"]
    ours = next(b for b in backends if b.url == "http://cb:1")
    for path, body in (
        ("/tokenize", {"model": "m", "prompt": "hi"}),
        ("/detokenize", {"tokens": [1]}),
    ):
        request = _request(body, path)
        plans = PlanMemo(request)
        assert BackendRegistry(backends).candidates(request, plans=plans) == [ours]
        for other in backends:
            if other is not ours:
                assert f"do not answer {path}" in (plans.plan(other).refusal or ""), other.url


def test_paths_an_upstream_relays_reach_it_and_others_do_not(tmp_path: Path) -> None:
    """``relayed_paths``: vLLM's /v1/rerank of an upstream is reachable through the gateway,
    body and answer as they are; a path no backend relays is a 404 naming it."""
    settings = FakeServerSettings(model_id="m", name="U", is_validating=False)
    server = start_fake_server(settings)
    entry = {"url": server.url, "relayed_paths": ["/v1/rerank"]}
    gateway = start_gateway(tmp_path, openai_compatible_server_urls=[entry])
    try:
        body = {"model": "m", "query": "capital of France", "documents": ["Paris", "Rome"]}
        answer = gateway.http.post("/v1/rerank", json=body)
        assert answer.status_code == 200, answer.text
        assert [r["index"] for r in answer.json()["results"]] == [0, 1]
        assert settings.requests[-1] == ("/v1/rerank", body)
        refused = gateway.http.post("/v1/score", json={"model": "m", "text_1": "a"})
        assert refused.status_code == 404 and "/v1/score" in refused.text, refused.text
    finally:
        stop_all(gateway, server)
