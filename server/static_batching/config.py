"""The static-batching server's JSON config (``configs/sb_server_config.json``).

Every section forbids unknown keys so that a misspelt key stops start-up with a message naming
it, instead of being silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from server.common.config import ServerConfigFile, ServingConfig
from utils.config import ConfigSection, resolve_path

TorchDtypeName = Literal["float32", "bfloat16", "float16", "auto"]


class SBBatcherConfig(ConfigSection):
    """How requests are packed into packages."""

    # The seed writes "16" as a string; pydantic's lax mode turns numeric strings into ints.
    package_max_workload: int = Field(ge=1, description="max beams (sequences) in one package")
    packaging_interval_seconds: float = Field(
        ge=0.0, description="how long the oldest waiting request waits for company"
    )
    max_queue_size: int = Field(
        default=256, ge=1, description="waiting requests beyond this are refused with 503"
    )


class SBWorkerConfig(ConfigSection):
    """How the model and tokenizer are loaded and run with transformers."""

    model_name_or_path: str
    tokenizer_name_or_path: str | None = None
    revision: str = "main"
    low_cpu_mem_usage: bool = True
    torch_dtype: TorchDtypeName = "float32"
    use_fast_tokenizer: bool = True
    trust_remote_code: bool = False
    # None lets transformers pick the format it finds; false with a safetensors-only folder fails.
    use_safetensors: bool | None = None
    # Max prompts per package (the seed's pipeline batch size); -1 means no limit beyond the
    # workload budget.
    batch_size: int = Field(default=-1, ge=-1)
    is_gptq_quantized: bool = False
    device: str = "cpu"
    num_threads: int | None = Field(default=None, ge=1)
    model_max_length: int | None = Field(default=None, ge=1)
    served_model_name: str | None = None

    @field_validator("batch_size")
    @classmethod
    def _check_batch_size(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (no limit) or a positive number of prompts")
        return value

    def resolved_model_path(self, config_file: str | Path) -> str:
        """The model folder, resolved against the current directory, else the config file."""
        return resolve_path(config_file, self.model_name_or_path)

    def resolved_tokenizer_path(self, config_file: str | Path) -> str:
        """The tokenizer folder (defaults to the model folder)."""
        value = self.tokenizer_name_or_path or self.model_name_or_path
        return resolve_path(config_file, value)


class SBServerConfig(ServerConfigFile):
    """The whole ``sb_server_config.json``; ``LLM_SUITE_SB_SERVER__SECTION__KEY`` overrides a key
    from the environment (``utils.env_overrides``)."""

    env_prefix: ClassVar[str] = "LLM_SUITE_SB_SERVER"
    file_name: ClassVar[str] = "sb_server_config.json"

    batcher_config: SBBatcherConfig
    worker_config: SBWorkerConfig
    serving_config: ServingConfig = Field(default_factory=ServingConfig)


def load_sb_server_config(path: str | Path) -> SBServerConfig:
    """Read and validate ``path`` (raises ``utils.config.ConfigError`` naming file and key)."""
    return SBServerConfig.load(path)
