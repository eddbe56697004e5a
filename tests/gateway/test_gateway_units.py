"""Gateway parts without HTTP: config validation, balancing policy, candidate lookup."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from client.backends.backend import Backend
from client.backends.kinds.openai_compatible_config import OpenAIJumperConfig
from client.backends.lease import InFlightLease
from client.backends.status import status_of
from client.balancing.policies import POLICIES, LeastOutstandingWork, make_policy
from client.balancing.registry import BackendRegistry
from client.config.loading import load_client_config
from client.config.schema import ClientConfig
from client.config.schema_common import is_placeholder_key
from client.gateway_request import GatewayRequest
from protocol.generation import GenerateRequest
from tests.gateway.backend_factory import healthy_server
from tests.support.paths import REPO_ROOT
from utils.config import ConfigError, load_config


def _request(model: str | None) -> GatewayRequest:
    return GatewayRequest(endpoint="/generate", parsed=GenerateRequest(model=model, prompt="hi"))


INFO = _request("m")


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "client_config.json"
    path.write_text(json.dumps(data))
    return path


def _backend(url: str, model: str = "m", kind: str = "static_batching", **load: int) -> Backend:
    return healthy_server(url, kind, [model], **load)


# -- config ---------------------------------------------------------------------------------


def test_shipped_config_loads() -> None:
    # Its servers are named by app: their URLs come from the deployment file beside it.
    config = load_client_config(
        REPO_ROOT / "configs" / "client_config.json", REPO_ROOT / "configs" / "deployment.json"
    )
    assert config.static_batching_server_urls == ["http://127.0.0.1:8002"]
    assert config.continuous_batching_server_urls == ["http://127.0.0.1:8001"]
    # The seed's template entry: a placeholder key, so disabled until a real key is put in.
    assert len(config.openai_jumper_configs) == 1 and config.enabled_jumpers == []
    assert config.heart_beat_interval_seconds == 10
    assert config.api_keys == []  # callers need no key by default (bound to 127.0.0.1)


def test_seed_template_placeholder_key_is_disabled_and_hidden() -> None:
    jumper = OpenAIJumperConfig.model_validate({"api_key": "YOUR_OPENAI_KEY", "org_id": None})
    assert not jumper.is_enabled
    real = OpenAIJumperConfig.model_validate({"api_key": "sk-live-abcdef123456"})
    assert real.is_enabled
    assert "sk-live" not in repr(real) and "sk-live" not in str(real)
    config = ClientConfig(openai_jumper_configs=[jumper, real])
    assert config.enabled_jumpers == [real]
    assert "sk-live" not in config.model_dump_json()
    for placeholder in ("", "  ", "<your key>", "${OPENAI_API_KEY}", "CHANGE_ME", "xxxx"):
        assert is_placeholder_key(placeholder), placeholder


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"static_batching_server_urls": ["http://h:1/"]}, "static_batching_server_urls"),
        ({"continuous_batching_server_urls": ["ftp://h:1"]}, "http:// or https://"),
        ({"static_batching_server_urls": ["http://h:1", "http://h:1"]}, "more than once"),
        ({"heart_beat_interval_seconds": 0}, "heart_beat_interval_seconds"),
        ({"balancing_policy": "random"}, "balancing_policy"),
        ({"heart_beat_interval": 5}, "heart_beat_interval: unknown key"),
        ({"openai_jumper_configs": [{"org_id": None}]}, "openai_jumper_configs.0.api_key"),
        ({"triton_server_urls": [{"url": "http://t:1"}]}, "triton_server_urls.0.models"),
        (
            {"triton_server_urls": [{"url": "http://t:1/", "models": {"m": "ensemble"}}]},
            "must not end with '/'",
        ),
        (
            {
                "static_batching_server_urls": ["http://t:1"],
                "triton_server_urls": [{"url": "http://t:1", "models": {"m": "ensemble"}}],
            },
            "both as a static-batching server and as a Triton server",
        ),
        (
            {
                "static_batching_server_urls": ["http://h:1"],
                "continuous_batching_server_urls": ["http://h:1"],
            },
            "both",
        ),
    ],
)
def test_bad_config_names_file_and_key(tmp_path: Path, data: dict, expected: str) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError, match=re.escape(str(path))) as excinfo:
        load_config(path, ClientConfig)
    assert str(path) in str(excinfo.value)
    assert expected in str(excinfo.value)


def test_build_app_raises_config_error(tmp_path: Path) -> None:
    from client_app import build_app

    with pytest.raises(ConfigError, match="static_batching_server_urls"):
        build_app(str(_write(tmp_path, {"static_batching_server_urls": "http://h:1"})))


# -- balancing policy -----------------------------------------------------------------------


def test_policy_registry() -> None:
    assert isinstance(make_policy(ClientConfig()), LeastOutstandingWork)
    assert set(POLICIES) == {"least_outstanding", "round_robin", "power_of_two", "affinity"}
    for name, policy_class in POLICIES.items():
        policy = make_policy(ClientConfig(balancing_policy=name))  # type: ignore[arg-type]
        assert type(policy) is policy_class
    config = ClientConfig.model_construct(balancing_policy="nope")
    with pytest.raises(ValueError, match="unknown balancing policy"):
        make_policy(config)


def test_least_outstanding_uses_reported_load_and_in_flight() -> None:
    policy = LeastOutstandingWork()
    busy = _backend("http://a:1", num_waiting=2, num_running=1)
    idle = _backend("http://b:1")
    assert policy.choose([busy, idle], INFO) is idle
    leases = [InFlightLease(idle) for _ in range(4)]  # idle now has 4 in flight vs 3 reported
    assert policy.choose([busy, idle], INFO) is busy
    for lease in leases:
        lease.release()
        lease.release()  # releasing twice counts once
    assert idle.num_in_flight == 0


def test_least_outstanding_spreads_over_equal_backends() -> None:
    policy = LeastOutstandingWork()
    backends = [_backend(f"http://s{i}:1") for i in range(3)]
    num_chosen = Counter(policy.choose(backends, INFO).url for _ in range(30))
    assert sorted(num_chosen.values()) == [10, 10, 10]


def test_least_outstanding_with_in_flight_leases_spreads_concurrent_requests() -> None:
    policy = LeastOutstandingWork()
    backends = [_backend("http://a:1"), _backend("http://b:1")]
    leases = [InFlightLease(policy.choose(backends, INFO)) for _ in range(6)]
    assert [b.num_in_flight for b in backends] == [3, 3]
    assert len(leases) == 6


# -- candidates -----------------------------------------------------------------------------


def test_candidates_by_model_health_and_kind() -> None:
    sb = _backend("http://sb:1", model="m")
    cb = _backend("http://cb:1", model="m", kind="continuous_batching")
    other = _backend("http://other:1", model="other")
    down = _backend("http://down:1", model="m", kind="continuous_batching")
    down.health.is_healthy = False
    registry = BackendRegistry([sb, cb, other, down])

    info = _request

    assert registry.candidates(info("m")) == [cb]  # CB preferred over SB
    assert registry.candidates(info("m"), exclude=[cb]) == [sb]
    assert registry.candidates(info("other")) == [other]
    assert registry.candidates(info("unknown")) == []
    assert registry.candidates(info(None)) == [cb]  # any model: best kind tier
    cb.health.is_healthy = False
    assert registry.candidates(info(None)) == [sb, other]
    assert registry.model_ids() == ["m", "other"]
    assert registry.model_ids(is_healthy_only=False) == ["m", "other"]


def test_backend_status_snapshot_is_json_ready() -> None:
    backend = _backend("http://a:1", num_waiting=1)
    status = status_of(backend).model_dump()
    assert status["url"] == "http://a:1"
    assert status["load"]["num_waiting"] == 1
    assert status["is_healthy"] is True
    backend.health.mark_unreachable("ConnectError: refused")
    assert status_of(backend).last_error == "ConnectError: refused"
    # The models are remembered.
    assert not backend.health.is_healthy and backend.health.model_ids == ["m"]


def test_breaker_reports_openings_and_adopts_shared_ones() -> None:
    from client.backends.circuit_breaker import CircuitBreaker

    opened: list[float] = []
    closed: list[bool] = []
    breaker = CircuitBreaker(failure_threshold=1, cooldown_seconds=10)
    breaker.on_open, breaker.on_close = opened.append, lambda: closed.append(True)
    assert breaker.record_failure(now=100.0)
    assert opened == [10.0] and breaker.num_trips == 1
    breaker.record_success()
    assert closed == [True]
    breaker.record_success()  # already closed: nothing to report
    assert closed == [True]
    # Another replica's opening: open here too, without a trip of our own or a report back.
    breaker.adopt_opening(5.0, now=200.0)
    assert breaker.state(now=204.0) == "open" and breaker.state(now=205.5) == "half_open"
    assert breaker.num_trips == 0 and opened == [10.0]
    breaker.adopt_opening(1.0, now=200.0)  # shorter than what holds: no change
    assert breaker.seconds_until_retry(now=200.0) == 5.0


# -- backend kinds --------------------------------------------------------------------------


def test_every_kind_brings_its_config_section() -> None:
    from client.config.kinds import KINDS, backends_from_config

    fields = set(ClientConfig.model_fields)
    for kind in KINDS:
        assert set(kind.section.model_fields) <= fields, kind.kind
    config = ClientConfig.model_validate(
        {
            "continuous_batching_server_urls": ["http://cb:1"],
            "static_batching_server_urls": ["http://sb:1"],
            "embedding_server_urls": ["http://emb:1"],
            "triton_server_urls": [{"url": "http://t:1", "models": {"m": "ensemble"}}],
            "openai_compatible_server_urls": [{"url": "http://vllm:1/v1"}],
            "openai_jumper_configs": [{"api_key": "sk-live-abcdef123456"}],
        }
    )
    backends = backends_from_config(config)
    assert [(b.kind, b.tier) for b in backends] == [
        ("continuous_batching", "first"),
        ("static_batching", "second"),
        ("embedding", "first"),
        ("triton", "first"),
        ("openai_compatible", "first"),
        ("openai_compatible", "fallback"),
    ]
    engine, account = backends[-2:]
    assert engine.name == "http://vllm:1" and not engine.uses_proxy
    assert account.name == "openai[0]@https://api.openai.com/v1" and account.uses_proxy
    assert account.url_for("/v1/chat/completions") == "https://api.openai.com/v1/chat/completions"
    assert engine.url_for("/v1/chat/completions") == "http://vllm:1/v1/chat/completions"
    assert engine.url_for("/health") == "http://vllm:1/health"


def test_an_engine_entry_may_sit_in_the_fallback_tier() -> None:
    from client.config.kinds import backends_from_config

    config = ClientConfig.model_validate(
        {
            "openai_compatible_server_urls": [
                {"url": "http://up:1", "tier": "fallback", "api_key": "sk-up-0123456789"},
                {"url": "http://sglang:1", "tier": "second"},
            ],
            "openai_jumper_configs": [{"api_key": "YOUR_OPENAI_KEY"}],
        }
    )
    account, engine = backends_from_config(config)
    # Numbered after the jumper entries (the disabled one included), never named by key.
    assert account.is_fallback and account.name == "openai[1]@http://up:1"
    assert account.health.is_healthy  # an account has no heartbeat: up unless it rests
    assert account.request_headers() == {"authorization": "Bearer sk-up-0123456789"}
    assert account.scrub("bad key sk-up-0123456789") == "bad key ***"
    assert not account.refuses_credentials(400) and account.refuses_credentials(401)
    assert account.health.breaker.state() == "open"  # a refused key rests
    assert engine.tier == "second" and not engine.health.is_healthy  # until a heartbeat
    assert not engine.refuses_credentials(401)  # an engine's 401 passes back to the caller


def test_failures_of_requests_sent_before_the_opening_do_not_grow_the_cooldown() -> None:
    """A server that dies with 12 streams in flight opens its circuit once, for the base
    cooldown; only a failed trial doubles it."""
    from client.backends.circuit_breaker import CircuitBreaker

    breaker = CircuitBreaker(failure_threshold=3, cooldown_seconds=15)
    now = 100.0
    opened = [breaker.record_failure(now) for _ in range(12)]
    assert opened.count(True) == 1
    assert breaker.seconds_until_retry(now) == 15
    later = now + 16  # half-open: the trial fails, the cooldown doubles
    breaker.on_request_sent(later)
    assert breaker.record_failure(later)
    assert breaker.seconds_until_retry(later) == 30
