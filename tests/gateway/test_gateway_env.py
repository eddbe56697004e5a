"""Config from the environment: ``LLM_SUITE_GATEWAY__...`` overrides, and secrets that name an
environment variable (``{"env": "NAME"}``) instead of living in the file. Real gateway and fake
servers on loopback sockets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from client.config.loading import load_client_config
from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import start_gateway, stop_all
from utils.config import ConfigError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
UPSTREAM_SECRET = "sk-upstream-from-env-0123456789"
CALLER_SECRET = "caller-key-from-env-0123456789"


def test_environment_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = start_fake_server(FakeServerSettings(model_id="m", kind="continuous_batching"))
    # The file lists a server that does not exist; the environment replaces the list.
    monkeypatch.setenv("LLM_SUITE_GATEWAY__CONTINUOUS_BATCHING_SERVER_URLS", f'["{server.url}"]')
    monkeypatch.setenv("llm_suite_gateway__max_attempts", "1")  # names are case-insensitive
    gateway = start_gateway(tmp_path, continuous_batching_server_urls=["http://127.0.0.1:9"])
    try:
        assert [row["url"] for row in gateway.http.get("/backends").json()["backends"]] == [
            server.url
        ]
        assert gateway.http.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert gateway.app.state.gateway.config.max_attempts == 1
    finally:
        stop_all(gateway, server)


def test_secrets_from_environment_variables_never_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("TEST_UPSTREAM_KEY", UPSTREAM_SECRET)
    monkeypatch.setenv("TEST_CALLER_KEY", CALLER_SECRET)
    upstream_settings = FakeServerSettings(model_id="m", name="U")
    upstream = start_fake_server(upstream_settings)
    jumper = {"api_key": {"env": "TEST_UPSTREAM_KEY"}, "base_url": f"{upstream.url}/v1"}
    gateway = start_gateway(
        tmp_path, openai_jumper_configs=[jumper], api_keys=[{"env": "TEST_CALLER_KEY"}]
    )
    try:
        assert gateway.http.post("/v1/chat/completions", json=CHAT).status_code == 401
        auth = {"Authorization": f"Bearer {CALLER_SECRET}"}
        answer = gateway.http.post("/v1/chat/completions", json=CHAT, headers=auth)
        assert answer.status_code == 200 and "[U]" in answer.text, answer.text
        assert upstream_settings.authorizations == [f"Bearer {UPSTREAM_SECRET}"]
        shown = [gateway.http.get(path, headers=auth).text for path in ("/backends", "/metrics")]
    finally:
        stop_all(gateway, upstream)
    for text in [*shown, caplog.text, *(p.read_text() for p in tmp_path.glob("*.json"))]:
        assert UPSTREAM_SECRET not in text and CALLER_SECRET not in text


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"openai_jumper_configs": [{"api_key": {"env": "NO_SUCH_UPSTREAM_KEY"}}]},
            "openai_jumper_configs.0.api_key: environment variable NO_SUCH_UPSTREAM_KEY",
        ),
        (
            {"api_keys": ["k-0123456789", {"env": "NO_SUCH_CALLER_KEY"}]},
            "api_keys.1: environment variable NO_SUCH_CALLER_KEY",
        ),
    ],
)
def test_a_missing_variable_is_a_startup_error_naming_it(
    tmp_path: Path, config: dict, expected: str
) -> None:
    path = tmp_path / "client.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as caught:
        load_client_config(path)
    assert f"{expected} is not set" in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_bad_override_names_its_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "client.json"
    path.write_text("{}")
    monkeypatch.setenv("LLM_SUITE_GATEWAY__HEART_BEAT_INTERVAL_SECOND", "5")  # misspelt
    monkeypatch.setenv("LLM_SUITE_GATEWAY__MAX_ATTEMPTS", "zero")
    with pytest.raises(ConfigError) as caught:
        load_client_config(path)
    message = str(caught.value)
    assert "heart_beat_interval_second: unknown key" in message
    assert "LLM_SUITE_GATEWAY__HEART_BEAT_INTERVAL_SECOND" in message
    assert "max_attempts" in message and "LLM_SUITE_GATEWAY__MAX_ATTEMPTS" in message
