"""The gateway's server lists may name deployment apps instead of URLs: the port then lives in the
deployment file only. Real fake servers and a real gateway on loopback sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from client.config.loading import load_client_config
from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import reserve_socket, start_gateway, stop_all
from launcher.deployment import AppEntry
from launcher.wiring_check import unmatched_gateway_urls
from utils.config import ConfigError
from utils.deployment_apps import DEPLOYMENT_FILE_ENV


def _deployment(path: Path, **ports: int) -> Path:
    apps = [{"name": name, "app": "cb_server", "port": port} for name, port in ports.items()]
    path.write_text(json.dumps({"apps": apps}))
    return path


def test_a_server_named_by_app_name_is_routed_to(tmp_path: Path) -> None:
    settings = FakeServerSettings(model_id="m", kind="continuous_batching")
    server = start_fake_server(settings)
    port = int(server.url.rsplit(":", 1)[1])
    deployment = _deployment(tmp_path / "deploy.json", cb_one=port)
    gateway = start_gateway(
        tmp_path, continuous_batching_server_urls=["cb_one"], deployment_file=str(deployment)
    )
    try:
        rows = gateway.http.get("/backends").json()["backends"]
        assert [row["url"] for row in rows] == [server.url]
        answer = gateway.http.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert answer.status_code == 200, answer.text
        assert [path for path, _ in settings.requests] == ["/v1/completions"]
    finally:
        stop_all(gateway, server)


def test_the_launchers_deployment_variable_and_the_default_beside_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "client.json"
    config.write_text(json.dumps({"static_batching_server_urls": ["sb", "http://h:9"]}))
    _deployment(tmp_path / "deployment.json", sb=8123)
    monkeypatch.delenv(DEPLOYMENT_FILE_ENV, raising=False)
    loaded = load_client_config(config)
    assert loaded.static_batching_server_urls == ["http://127.0.0.1:8123", "http://h:9"]
    elsewhere = _deployment(tmp_path / "other.json", sb=8200)
    monkeypatch.setenv(DEPLOYMENT_FILE_ENV, str(elsewhere))
    loaded = load_client_config(config)
    assert loaded.static_batching_server_urls == ["http://127.0.0.1:8200", "http://h:9"]


def test_an_unknown_app_name_names_both_files_and_the_apps(tmp_path: Path) -> None:
    deployment = _deployment(tmp_path / "deploy.json", cb=8001)
    config = tmp_path / "client.json"
    config.write_text(
        json.dumps(
            {"continuous_batching_server_urls": ["cb_srv"], "deployment_file": "deploy.json"}
        )
    )
    with pytest.raises(ConfigError) as caught:
        load_client_config(config)
    message = str(caught.value)
    assert str(config) in message and str(deployment) in message
    assert "'cb_srv'" in message and "cb" in message


def test_a_name_and_its_url_listed_together_are_a_duplicate(tmp_path: Path) -> None:
    _deployment(tmp_path / "deployment.json", cb=8001)
    config = tmp_path / "client.json"
    urls = ["cb", "http://127.0.0.1:8001"]
    config.write_text(json.dumps({"continuous_batching_server_urls": urls}))
    with pytest.raises(ConfigError, match="more than once"):
        load_client_config(config, tmp_path / "deployment.json")


def test_wiring_warning_names_both_files(tmp_path: Path) -> None:
    with reserve_socket() as stale_port:
        stale = stale_port.getsockname()[1]
        config = tmp_path / "client.json"
        config.write_text(
            json.dumps({"continuous_batching_server_urls": ["cb", f"http://127.0.0.1:{stale}"]})
        )
        deployment = _deployment(tmp_path / "deploy.json", cb=8001)
        entries = [
            AppEntry(name="cb", app="cb_server", port=8001),
            AppEntry(name="gw", app="client", config=str(config), port=1),
        ]
        warnings = unmatched_gateway_urls(entries, deployment)
    assert len(warnings) == 1, warnings  # "cb" is the deployment's own app
    assert str(config) in warnings[0] and str(deployment) in warnings[0]
    assert f":{stale}" in warnings[0]
