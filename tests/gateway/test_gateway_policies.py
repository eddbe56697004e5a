"""Gateway parts without HTTP: each balancing policy on crafted loads, the circuit breaker,
jumper keys, affinity keys, caller auth and config re-application."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from pydantic import SecretStr

from client.backends.backend import Backend
from client.backends.circuit_breaker import CircuitBreaker
from client.backends.kinds.openai_compatible import OpenAICompatibleUpstream
from client.backends.kinds.openai_compatible_config import OpenAIJumperConfig
from client.backends.lease import InFlightLease
from client.backends.native_as_openai import OpenAIShaper
from client.backends.native_to_openai import (
    OpenAIStreamTranslator,
    answer_from_openai,
    to_openai,
    upstream_unsupported_fields,
)
from client.backends.plan_memo import PlanMemo
from client.backends.status import status_of
from client.backends.translation import SecretScrubber
from client.balancing.policies import (
    LeastRecentlyUsedKey,
    PowerOfTwoChoices,
    RoundRobin,
    SessionAffinity,
    affinity_key_of,
)
from client.balancing.registry import BackendRegistry
from client.config.schema import ClientConfig
from client.gateway_request import GatewayRequest, Route
from client.intake.auth import check_caller
from client.triton.config import TritonServerConfig
from client.triton.server_kind import TritonServer
from protocol.generation import GenerateRequest
from protocol.health import LoadReport
from protocol.openai_api import ChatCompletionRequest, ChatMessage, CompletionRequest
from tests.gateway.backend_factory import healthy_server, jumper
from utils.errors import APIError


def _request(
    endpoint: str = "/generate",
    route: Route = "auto",
    session_id: str | None = None,
    **body: object,
) -> GatewayRequest:
    """A gateway request for model ``m`` as the intake would build it from ``body``."""
    schema = {
        "/generate": GenerateRequest,
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
    }[endpoint]
    if endpoint == "/v1/chat/completions":
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        body.setdefault("prompt", "hi")
    parsed = schema.model_validate({"model": "m", **body})
    return GatewayRequest(endpoint=endpoint, parsed=parsed, route=route, session_id=session_id)


INFO = _request("/v1/chat/completions")


def _backend(url: str, **load: int) -> Backend:
    return healthy_server(url, "continuous_batching", ["m"], **load)


def _info(key: str | None) -> GatewayRequest:
    return _request(session_id=key)


# -- policies -------------------------------------------------------------------------------


def test_round_robin_ignores_load() -> None:
    backends = [
        _backend("http://a:1", num_running=50),
        _backend("http://b:1"),
        _backend("http://c:1"),
    ]
    policy = RoundRobin()
    chosen = [policy.choose(backends, INFO).url for _ in range(6)]
    assert chosen == ["http://a:1", "http://b:1", "http://c:1"] * 2


def test_power_of_two_picks_the_less_loaded_of_its_pair() -> None:
    loads = [0, 5, 10, 20]
    backends = [_backend(f"http://s{load}:1", num_running=load) for load in loads]
    policy = PowerOfTwoChoices(random.Random(0))
    num_chosen = Counter(policy.choose(backends, INFO).url for _ in range(1200))
    # The most loaded server is never the less loaded of a pair; the idle one wins every pair
    # it is in (half of all pairs), the next one a third of them.
    assert num_chosen["http://s20:1"] == 0
    assert 500 < num_chosen["http://s0:1"] < 700
    assert 300 < num_chosen["http://s5:1"] < 500
    assert num_chosen["http://s0:1"] > num_chosen["http://s5:1"] > num_chosen["http://s10:1"]
    # In-flight requests count too: make the idle one the busiest.
    leases = [InFlightLease(backends[0]) for _ in range(30)]
    assert all(policy.choose(backends, INFO) is not backends[0] for _ in range(50))
    for lease in leases:
        lease.release()
    assert policy.choose(backends[:1], INFO) is backends[0]


def test_affinity_keeps_a_conversation_on_one_server() -> None:
    backends = [_backend(f"http://s{i}:1") for i in range(4)]
    policy = SessionAffinity(max_imbalance=8)
    keys = [f"conversation-{i}" for i in range(40)]
    first = {key: policy.choose(backends, _info(key)) for key in keys}
    assert len(set(first.values())) == 4  # keys spread over all servers
    assert all(policy.choose(backends, _info(key)) is first[key] for key in keys)
    # A server leaves: only its conversations move; the others keep their server.
    gone = backends[1]
    remaining = [b for b in backends if b is not gone]
    for key in keys:
        chosen = policy.choose(remaining, _info(key))
        if first[key] is not gone:
            assert chosen is first[key]
    # It comes back: its conversations return to it.
    assert all(policy.choose(backends, _info(key)) is first[key] for key in keys)


def test_affinity_leaves_an_overloaded_server_and_balances_keyless_requests() -> None:
    backends = [_backend("http://a:1"), _backend("http://b:1")]
    policy = SessionAffinity(max_imbalance=3)
    preferred = policy.choose(backends, _info("chat-1"))
    other = next(b for b in backends if b is not preferred)
    preferred.health.load = LoadReport(num_running=3)
    assert policy.choose(backends, _info("chat-1")) is preferred  # within the allowed imbalance
    preferred.health.load = LoadReport(num_running=4)
    assert policy.choose(backends, _info("chat-1")) is other
    # No key: least outstanding work.
    assert policy.choose(backends, _info(None)) is other


def test_affinity_key_of_request_parts() -> None:
    system = ChatMessage(role="system", content="be brief")
    question = ChatMessage(role="user", content="hi")
    answer = ChatMessage(role="assistant", content="hello")
    follow_up = ChatMessage(role="user", content="and then?")
    turn_1 = affinity_key_of(None, None, None, [system, question])
    turn_2 = affinity_key_of(None, None, None, [system, question, answer, follow_up])
    assert turn_1 is not None and turn_1 == turn_2  # the growing chat keeps its key
    other_chat = affinity_key_of(None, None, None, [system, ChatMessage(role="user", content="yo")])
    assert other_chat != turn_1
    assert affinity_key_of("abc", "alice", "p", None) == "session:abc"
    assert affinity_key_of(None, "alice", "p", None) == "user:alice"
    assert affinity_key_of(None, None, "x" * 1000, None) == affinity_key_of(
        None, None, "x" * 256 + "different tail", None
    )
    assert affinity_key_of(None, None, None, None) is None


# -- circuit breaker ------------------------------------------------------------------------


def test_circuit_breaker_opens_half_opens_and_closes() -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown_seconds=10)
    assert not breaker.record_failure(now=0) and not breaker.record_failure(now=1)
    breaker.record_success()  # a success in between resets the count
    assert not breaker.record_failure(now=2) and not breaker.record_failure(now=3)
    assert breaker.record_failure(now=4)
    assert breaker.state(now=5) == "open" and not breaker.allows_request(now=5)
    assert breaker.seconds_until_retry(now=5) == pytest.approx(9)
    # Cooldown over: one trial request.
    assert breaker.state(now=14.5) == "half_open" and breaker.allows_request(now=14.5)
    breaker.on_request_sent(now=14.5)
    assert not breaker.allows_request(now=14.6)
    # The trial fails: open again, twice as long.
    assert breaker.record_failure(now=15)
    assert breaker.state(now=34) == "open" and breaker.state(now=35.1) == "half_open"
    breaker.on_request_sent(now=36)
    breaker.record_success()
    assert breaker.state(now=36) == "closed" and breaker.num_trips == 0
    # A server back from down (restarted) gets its trial at once, not after the cooldown.
    for second in range(3):
        breaker.record_failure(now=40 + second)
    assert breaker.state(now=43) == "open"
    breaker.end_cooldown(now=43)
    assert breaker.state(now=43) == "half_open" and breaker.allows_request(now=43)


def test_lease_verdicts_drive_the_breaker() -> None:
    backend = _backend("http://a:1")
    backend.health.breaker = CircuitBreaker(failure_threshold=2, cooldown_seconds=60)
    for _ in range(2):
        InFlightLease(backend).release(is_failure=True)
    assert not backend.health.is_routable()
    assert backend.health.num_failures == 2 and status_of(backend).circuit == "open"
    registry = BackendRegistry([backend, _backend("http://b:1")])
    assert [b.url for b in registry.candidates(_request())] == ["http://b:1"]


def test_failed_heartbeats_mark_down_after_threshold() -> None:
    backend = _backend("http://a:1")
    backend.health.num_failures_to_mark_down = 2
    backend.health.record_failed_heartbeat("timeout")
    assert backend.health.is_healthy
    backend.health.record_failed_heartbeat("timeout")
    assert not backend.health.is_healthy and backend.health.last_error == "timeout"


def test_backend_kinds_are_asked_lazily_and_once() -> None:
    local = _backend("http://a:1")
    key = _jumper("sk-key-0-abcdefgh")
    triton = TritonServer.from_entry(TritonServerConfig(url="http://t:1", models={"m": "ensemble"}))
    triton.health.is_healthy, triton.health.model_ids = True, ["m"]
    native = _request("/generate", stream=True)
    plans = PlanMemo(native)  # what the forwarding side keeps for one request
    registry = BackendRegistry([local, key])
    assert registry.candidates(native, plans=plans) == [local]
    # Our server takes the request as sent: the jumper was never asked to translate it.
    assert key not in plans
    local.health.is_healthy = False
    assert registry.candidates(native, plans=plans) == [key]
    assert key in plans
    plan = plans.plan(key)
    assert plan.translation is not None
    assert registry.candidates(native, plans=plans) == [key] and plans.plan(key) is plan  # kept
    # A Triton server shares the first tier: it is asked, and its translation is built once.
    chat = _request("/v1/chat/completions")
    chat_plans = PlanMemo(chat)
    assert BackendRegistry([triton, key]).candidates(chat, plans=chat_plans) == [key]
    assert triton in chat_plans and "not messages" in (chat_plans.plan(triton).refusal or "")
    completion = _request("/v1/completions", max_tokens=3, temperature=0)
    completion_plans = PlanMemo(completion)
    registry = BackendRegistry([triton, key])
    assert registry.candidates(completion, plans=completion_plans) == [triton]
    translation = completion_plans.plan(triton).translation
    assert translation is not None
    path, body = translation.request()
    assert path == "/v2/models/ensemble/generate"
    assert json.loads(body)["text_input"] == "hi" and json.loads(body)["max_tokens"] == 3
    beams = _request("/v1/completions", use_beam_search=True, n=2, ignore_eos=True)
    beams_plans = PlanMemo(beams)
    assert BackendRegistry([triton]).candidates(beams, plans=beams_plans) == []
    assert "ignore_eos" in (beams_plans.plan(triton).refusal or "")


# -- jumpers --------------------------------------------------------------------------------


def _jumper(key: str, index: int = 0, **fields: object) -> OpenAICompatibleUpstream:
    config = OpenAIJumperConfig.model_validate(
        {"api_key": key, "base_url": "http://up:1/v1", **fields}
    )
    return jumper(config, index)


def test_jumper_maps_models_paths_and_hides_its_key() -> None:
    jumper = _jumper("sk-secret-123456789", models=["gpt-x"], model_map={"local": "gpt-y"})
    assert jumper.health.model_ids == ["gpt-x", "local"]
    assert jumper.serves("local") and jumper.serves("gpt-x") and not jumper.serves("other")
    assert jumper.upstream_model("local") == "gpt-y" and jumper.upstream_model("gpt-x") == "gpt-x"
    assert jumper.url_for("/v1/chat/completions") == "http://up:1/v1/chat/completions"
    chat = _request("/v1/chat/completions", model="local")
    native = _request("/generate", model="local")
    assert jumper.plan_for(chat).is_accepted and jumper.plan_for(native).is_accepted
    assert jumper.plan_for(chat).translation is None  # OpenAI requests go unchanged
    assert jumper.plan_for(native).translation is not None  # native ones are translated
    beams = _request("/generate", model="local", generation_config={"num_beams": 2})
    assert "generation_config.num_beams" in (jumper.plan_for(beams).refusal or "")
    assert jumper.request_headers()["authorization"] == "Bearer sk-secret-123456789"
    assert "secret" not in jumper.name and "secret" not in status_of(jumper).model_dump_json()
    assert jumper.scrub("bad key sk-secret-123456789!") == "bad key ***!"
    assert _jumper("sk-any-key-000000").serves("anything")  # no list: any model


def test_registry_prefers_local_and_picks_least_recently_used_key() -> None:
    local = _backend("http://a:1")
    keys = [_jumper(f"sk-key-{i}-abcdefgh", index=i) for i in range(3)]
    registry = BackendRegistry([local, *keys])
    path = "/v1/chat/completions"

    def info(endpoint: str = path, route: Route = "auto", **body: object) -> GatewayRequest:
        return _request(endpoint, route, **body)

    assert registry.candidates(info()) == [local]
    assert registry.candidates(info("/generate", "openai")) == keys  # translated
    # ... unless the request uses what the OpenAI API lacks.
    unsupported = info("/generate", "openai", generation_config={"top_k": 5})
    assert registry.candidates(unsupported) == []
    assert registry.candidates(info(route="openai")) == keys
    local.health.is_healthy = False
    assert registry.candidates(info()) == keys  # the fallback tier
    assert registry.candidates(info(route="local")) == []
    keys[1].rest(30)
    assert registry.candidates(info()) == [keys[0], keys[2]]
    # Least recently used first: each use sends the key to the back of the line.
    policy = LeastRecentlyUsedKey()
    order = []
    for _ in range(4):
        chosen = policy.choose(registry.candidates(info()), info())
        InFlightLease(chosen).release()
        order.append(chosen.index)  # type: ignore[attr-defined]
    assert order == [0, 2, 0, 2]


async def test_apply_config_keeps_state_of_kept_backends() -> None:
    key = {"api_key": "sk-kept-key-12345678", "base_url": "http://up:1/v1"}
    config = ClientConfig(
        continuous_batching_server_urls=["http://a:1", "http://b:1"], openai_jumper_configs=[key]
    )
    registry = BackendRegistry.from_config(config)
    a, _, jumper = registry.backends
    a.health.is_healthy = True
    jumper.rest(100)  # type: ignore[attr-defined]
    new_config = ClientConfig(
        continuous_batching_server_urls=["http://a:1", "http://c:1"],
        openai_jumper_configs=[key, {"api_key": "sk-new-key-12345678"}],
        circuit_breaker_failures=7,
    )
    added = await registry.apply_config(new_config)  # not started: nothing is probed
    assert [b.name for b in added] == ["http://c:1", "openai[1]@https://api.openai.com/v1"]
    assert registry.backends[0] is a and a.health.is_healthy
    assert registry.backends[2] is jumper and jumper.health.breaker.state() == "open"
    assert all(b.health.breaker.failure_threshold == 7 for b in registry.backends)


# -- caller auth ----------------------------------------------------------------------------


def test_check_caller() -> None:
    check_caller(None, [])  # no keys configured: open
    keys = [SecretStr("caller-key-1"), SecretStr("caller-key-2")]
    check_caller("Bearer caller-key-2", keys)
    check_caller("bearer  caller-key-1 ", keys)
    for header, expected in [
        (None, "requires an API key"),
        ("Basic abc", "Bearer <key>"),
        ("Bearer wrong-key-999", "not valid"),
    ]:
        with pytest.raises(APIError, match=expected) as excinfo:
            check_caller(header, keys)
        assert excinfo.value.status_code == 401
        assert "wrong-key-999" not in excinfo.value.message
        assert excinfo.value.headers["WWW-Authenticate"] == "Bearer"


# -- native requests through a jumper ---------------------------------------------------------


def test_native_request_translation_and_unsupported_fields() -> None:
    request = GenerateRequest.model_validate(
        {"prompt": "hi", "generation_config": {"num_beams": 2, "top_k": 5, "ignore_eos": True}}
    )
    assert upstream_unsupported_fields(request) == (
        "generation_config.num_beams",
        "generation_config.top_k",
        "generation_config.ignore_eos",
    )
    greedy = GenerateRequest.model_validate({"prompt": "hi", "stream": True})
    assert upstream_unsupported_fields(greedy) == ()
    path, body = to_openai(greedy, "gpt-y")
    assert path == "/v1/completions"
    assert json.loads(body) == {
        "model": "gpt-y",
        "prompt": "hi",
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chat = json.dumps(
        {
            "id": "c1",
            "model": "gpt-y",
            "choices": [
                {"index": 0, "message": {"content": "Paris."}, "finish_reason": "content_filter"}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    ).encode()
    answer = json.loads(answer_from_openai(chat, "smol"))
    assert answer["model"] == "smol"
    assert answer["choices"] == [{"index": 0, "text": "Paris.", "finish_reason": "stop"}]


def test_openai_knobs_go_upstream_and_min_p_does_not() -> None:
    """OpenAI has the penalties and logit_bias (with our meaning); it lacks min_p."""
    knobs = {"presence_penalty": 0.5, "frequency_penalty": -0.25, "logit_bias": {"42": -100}}
    request = GenerateRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "generation_config": knobs}
    )
    assert upstream_unsupported_fields(request) == ()
    path, body = to_openai(request, None)
    assert path == "/v1/chat/completions"
    sent = json.loads(body)
    assert {name: sent[name] for name in knobs} == {**knobs, "logit_bias": {"42": -100.0}}
    min_p = GenerateRequest.model_validate(
        {"prompt": "hi", "generation_config": {"do_sample": True, "min_p": 0.1}}
    )
    assert upstream_unsupported_fields(min_p) == ("generation_config.min_p",)
    vllm_only = {
        "allowed_token_ids": [1, 2],
        "bad_words": ["x"],
        "structured_outputs": {"regex": "[a-z]+"},
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    request = GenerateRequest.model_validate({"prompt": "hi", "generation_config": vllm_only})
    assert upstream_unsupported_fields(request) == tuple(
        f"generation_config.{name}" for name in vllm_only
    )


def test_stream_translation_survives_any_chunking() -> None:
    events = [
        {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "Pa"}}]},
        {
            "id": "c",
            "choices": [{"index": 0, "delta": {"content": "ris"}, "finish_reason": "stop"}],
        },
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}},
    ]
    upstream = b"".join(f"data: {json.dumps(e)}\r\n\r\n".encode() for e in events)
    upstream += b": keep-alive\n\ndata: [DONE]\n\n"
    expected = OpenAIStreamTranslator("m").feed(upstream)
    lines = [line for line in expected.decode().splitlines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4  # the role-only event is dropped
    assert json.loads(lines[0][6:]) == {
        "id": "c",
        "model": "m",
        "choices": [{"index": 0, "text": "Pa", "finish_reason": None}],
    }
    for size in (1, 2, 7, 50):
        translator = OpenAIStreamTranslator("m")
        pieces = [upstream[i : i + size] for i in range(0, len(upstream), size)]
        assert b"".join(translator.feed(piece) for piece in pieces) == expected


# -- OpenAI requests in native terms (for Triton backends) -----------------------------------


def test_native_equivalent_of_openai_requests() -> None:
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": ["."]}
    )
    native = completion.to_generate_request()
    assert native is not None and native.prompt == "hi" and native.model == "m"
    assert native.generation_config.max_new_tokens == 5
    assert native.generation_config.stop == ["."] and not native.generation_config.do_sample
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    native = chat.to_generate_request()
    assert native is not None and native.messages is not None and native.stream
    for body in (
        {"model": "m", "prompt": ["a", "b"]},  # several prompts
        {"model": "m", "prompt": [1, 2, 3]},  # token ids
    ):
        assert CompletionRequest.model_validate(body).to_generate_request() is None


def test_openai_shaper_builds_chat_answers_and_chunks() -> None:
    shaper = OpenAIShaper("/v1/chat/completions", "smol", is_usage_streamed=True)
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    native = {"id": "x1", "choices": [{"index": 0, "text": "Paris", "finish_reason": None}]}
    answer = shaper.answer({**native, "usage": usage})
    assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-x1"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}
    first = json.loads(shaper.chunk(native).decode()[6:])
    second = json.loads(shaper.chunk(native).decode()[6:])
    assert first["choices"][0]["delta"] == {"content": "Paris", "role": "assistant"}
    assert second["choices"][0]["delta"] == {"content": "Paris"}  # the role comes once
    (usage_event,) = [
        e for e in shaper.chunk({"id": "x1", "choices": [], "usage": usage}).split(b"\n\n") if e
    ]
    assert json.loads(usage_event[6:])["usage"] == usage
    quiet = OpenAIShaper("/v1/completions", "smol", is_usage_streamed=False)
    assert quiet.chunk({"id": "x1", "choices": [], "usage": usage}) == b""
    assert json.loads(quiet.chunk(native)[6:])["choices"][0]["text"] == "Paris"


def test_secret_scrubber_masks_keys_split_across_chunks() -> None:
    key = "sk-secret-0123456789"
    stream = (
        b'data: {"choices": [{"text": "sk"}]}\n\n'
        + f'data: {{"error": {{"message": "bad key {key}, and {key}!"}}}}\n\n'.encode()
        + b"data: [DONE]\n\n"
    )
    expected = stream.replace(key.encode(), b"***")
    for size in (1, 2, 3, 7, 19, 20, 21, len(stream)):
        scrubber = SecretScrubber(key)
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        out = [scrubber.feed(piece) for piece in pieces]
        assert b"".join(out) + scrubber.close() == expected
        # Only what could begin the key waits: complete events go out with their chunk.
        assert b"".join(out).endswith(b"[DONE]\n\n")
