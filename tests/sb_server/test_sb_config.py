"""The static-batching server's config: the shipped file, the seed's quirks, clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from server.static_batching.backend import load_model
from server.static_batching.config import SBServerConfig, load_sb_server_config
from tests.support.paths import REPO_ROOT
from utils.config import ConfigError

SHIPPED_CONFIG = REPO_ROOT / "configs" / "sb_server_config.json"


def write_config(tmp_path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as a config file and return its path."""
    path = tmp_path / "sb_server_config.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def shipped() -> dict[str, Any]:
    """The shipped config as plain data."""
    return json.loads(SHIPPED_CONFIG.read_text(encoding="utf-8"))


def test_shipped_config_loads() -> None:
    config = load_sb_server_config(SHIPPED_CONFIG)
    assert config.batcher_config.package_max_workload == 16
    assert config.batcher_config.packaging_interval_seconds == 0.05
    assert config.worker_config.torch_dtype == "float32"
    assert config.worker_config.model_name_or_path == "models/SmolLM2-135M-Instruct"
    assert config.serving_config.default_max_new_tokens == 256


def test_seed_template_string_workload_and_defaults() -> None:
    config = SBServerConfig.model_validate(
        {
            "batcher_config": {"package_max_workload": "16", "packaging_interval_seconds": 2},
            "worker_config": {"model_name_or_path": "m"},
        }
    )
    assert config.batcher_config.package_max_workload == 16
    assert config.batcher_config.max_queue_size == 256
    assert config.worker_config.batch_size == -1
    assert config.serving_config.request_timeout_seconds == 600


def test_misspelt_key_is_named(tmp_path: Path) -> None:
    data = shipped()
    data["batcher_config"]["package_max_workloads"] = 8
    with pytest.raises(ConfigError, match=r"batcher_config\.package_max_workloads: unknown key"):
        load_sb_server_config(write_config(tmp_path, data))


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("batcher_config", "package_max_workload", 0),
        ("batcher_config", "packaging_interval_seconds", -1),
        ("worker_config", "torch_dtype", "float8"),
        ("worker_config", "batch_size", 0),
    ],
)
def test_bad_values_are_named(tmp_path: Path, section: str, key: str, value: Any) -> None:
    data = shipped()
    data[section][key] = value
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: "):
        load_sb_server_config(write_config(tmp_path, data))


def test_gptq_is_refused_clearly(tmp_path: Path) -> None:
    data = shipped()
    data["worker_config"]["is_gptq_quantized"] = True
    config = load_sb_server_config(write_config(tmp_path, data))
    with pytest.raises(ConfigError, match="is_gptq_quantized: GPTQ models are not supported"):
        load_model(config.worker_config, config.config_file)


def test_missing_model_folder_is_named(tmp_path: Path) -> None:
    data = shipped()
    data["worker_config"]["model_name_or_path"] = "models/no-such-model"
    config = load_sb_server_config(write_config(tmp_path, data))
    with pytest.raises(ConfigError, match="model_name_or_path: 'models/no-such-model' is not"):
        load_model(config.worker_config, config.config_file)
