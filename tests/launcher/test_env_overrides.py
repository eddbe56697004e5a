"""``utils.env_overrides`` through the loaders that use it: the servers' configs and the
deployment file, whose app addresses the gateway reads with the same overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.console import StartAppError
from launcher.deployment import load_deployment
from server.continuous_batching.cb_server_config import CBServerConfig
from server.static_batching.config import SBServerConfig
from tests.support.paths import REPO_ROOT
from utils.config import ConfigError, load_config
from utils.deployment_apps import app_urls
from utils.env_overrides import EnvOverrideError, apply_env_overrides

CONFIGS = REPO_ROOT / "configs"


def test_server_configs_take_nested_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_SUITE_CB_SERVER__CACHE_CONFIG__MEMORY_BUDGET_GB", "0.5")
    monkeypatch.setenv("LLM_SUITE_CB_SERVER__MODEL_LOADING_CONFIG__NUM_THREADS", "3")
    monkeypatch.setenv("LLM_SUITE_CB_SERVER__CACHE_CONFIG__NUM_BLOCKS", "null")
    monkeypatch.setenv("LLM_SUITE_SB_SERVER__WORKER_CONFIG__TORCH_DTYPE", "bfloat16")
    # A JSON object replaces the whole section (its other keys take their defaults).
    monkeypatch.setenv("LLM_SUITE_SB_SERVER__SERVING_CONFIG", '{"default_max_new_tokens": 7}')
    cb = load_config(CONFIGS / "cb_server_config.json", CBServerConfig)
    assert cb.cache_config.memory_budget_gb == 0.5 and cb.cache_config.num_blocks is None
    assert cb.model_loading_config.num_threads == 3
    assert cb.batcher_config.batch_max_tokens == 1024  # untouched keys keep the file's value
    sb = load_config(CONFIGS / "sb_server_config.json", SBServerConfig)
    assert sb.worker_config.torch_dtype == "bfloat16"
    assert sb.serving_config.default_max_new_tokens == 7
    assert sb.serving_config.request_timeout_seconds == 600


def test_a_bad_server_override_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_SUITE_CB_SERVER__CACHE_CONFIG__BLOCK_SIZE", "-1")
    with pytest.raises(ConfigError, match="LLM_SUITE_CB_SERVER__CACHE_CONFIG__BLOCK_SIZE"):
        load_config(CONFIGS / "cb_server_config.json", CBServerConfig)


def test_lists_by_index_and_by_name() -> None:
    data = {"apps": [{"name": "cb", "port": 1}, {"name": "gw", "port": 2}], "keys": ["a"]}
    environ = {
        "P__APPS__GW__PORT": "9",
        "P__APPS__0__HOST": "0.0.0.0",
        "P__KEYS__1": "b",
        "OTHER__KEYS": "x",
    }
    applied = apply_env_overrides(data, "P", environ)
    assert data == {
        "apps": [{"name": "cb", "port": 1, "host": "0.0.0.0"}, {"name": "gw", "port": "9"}],
        "keys": ["a", "b"],
    }
    assert applied[("apps", 1, "port")] == "P__APPS__GW__PORT"
    with pytest.raises(EnvOverrideError, match="P__APPS__NOPE__PORT: no element named 'nope'"):
        apply_env_overrides(data, "P", {"P__APPS__NOPE__PORT": "1"})


def test_deployment_overrides_move_a_port_for_the_launcher_and_the_gateway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"apps": [{"name": "cb_server", "app": "cb_server", "port": 1}]}))
    monkeypatch.setenv("LLM_SUITE_DEPLOYMENT__APPS__CB_SERVER__PORT", "9001")
    assert load_deployment(path).apps[0].port == 9001
    assert app_urls(path) == {"cb_server": "http://127.0.0.1:9001"}
    monkeypatch.setenv("LLM_SUITE_DEPLOYMENT__APPS__CB_SERVER__PORT", "99999")
    with pytest.raises(StartAppError, match="LLM_SUITE_DEPLOYMENT__APPS__CB_SERVER__PORT"):
        load_deployment(path)
