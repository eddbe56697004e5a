"""The CB server's JSON config (``configs/cb_server_config.json``): the engine's sections plus
``serving_config``. Relative model paths resolve against the current directory, then the
config file's folder and the folder above it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from server.common.config import ServerConfigFile, ServingConfig, check_model_folder
from server.continuous_batching.engine_config import EngineConfig
from utils.config import ConfigError, resolve_path


class CBServerConfig(ServerConfigFile, EngineConfig):
    """The whole ``cb_server_config.json``; ``LLM_SUITE_CB_SERVER__SECTION__KEY`` overrides a key
    from the environment (``utils.env_overrides``)."""

    env_prefix: ClassVar[str] = "LLM_SUITE_CB_SERVER"
    file_name: ClassVar[str] = "cb_server_config.json"

    serving_config: ServingConfig = Field(default_factory=ServingConfig)

    def engine_config(self) -> EngineConfig:
        """The engine's part of the config."""
        return EngineConfig.model_validate(self.model_dump(exclude={"serving_config"}))


def load_cb_server_config(path: str | Path) -> CBServerConfig:
    """Read, validate and resolve paths; raises ``ConfigError`` naming file, key and problem."""
    config = CBServerConfig.load(path)
    loading = config.model_loading_config
    loading.model_name_or_path = resolve_path(path, loading.model_name_or_path)
    if loading.tokenizer_name_or_path:
        loading.tokenizer_name_or_path = resolve_path(path, loading.tokenizer_name_or_path)
    gguf = loading.gguf_path
    if gguf is not None:
        if not gguf.is_file():
            raise ConfigError(f"{path}: model_loading_config: no GGUF file at {gguf}")
        return config
    model_dir = check_model_folder(
        path, "model_loading_config.model_name_or_path", loading.model_name_or_path
    )
    try:
        checkpoint = json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: model_loading_config.model_name_or_path: {model_dir}/config.json is not "
            f"valid JSON ({exc})"
        ) from None
    try:  # early, with the file named; load_model checks GGUF files and direct engine users
        loading.check_checkpoint_model_type(checkpoint.get("model_type"))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config
