"""Config plumbing every model server shares: the ``serving_config`` section, the base of a
server's whole config file, the one model-folder check, and the settings the HTTP layer runs
with (``ServingSettings``).

Each server's file (``cb_server_config.json``, ``sb_server_config.json``,
``embedding_server_config.json``) keeps its own keys; only their plumbing lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, ClassVar, Literal, Self

from pydantic import Field, PrivateAttr

from server.common.reasoning import ReasoningParserName
from server.common.responses_store import DEFAULT_MAX_STORED_RESPONSES
from server.common.tool_syntax import ToolCallParserName
from utils.config import ConfigError, ConfigSection, load_config
from utils.connection_limits import ConnectionLimits

#: ``serving_config.request_timeout_seconds``: its constraint and meaning, declared once (a
#: server may give it another default).
RequestTimeoutSeconds = Annotated[
    float, Field(gt=0.0, description="a request running longer is aborted (504)")
]
#: ``serving_config.max_request_bytes``, likewise.
MaxRequestBytes = Annotated[int, Field(gt=0, description="larger request bodies are refused (413)")]

#: ``serving_config.unknown_fields``: what an OpenAI body's undeclared fields get.
UnknownFieldsPolicy = Literal["reject", "warn"]

#: How to get a model, for the messages about a missing model folder.
_MODEL_FOLDER_HINT = (
    "models are loaded from local folders only; `make model` (python -m tools.prepare_model) "
    "prepares the default one"
)


@dataclass
class ServingSettings:
    """What the HTTP layer of a generation server needs to know beyond the backend itself."""

    served_model_names: list[str]
    default_max_new_tokens: int = 256
    request_timeout_seconds: float = 600.0
    max_request_bytes: int = 1_000_000
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    #: What an OpenAI body's undeclared fields get (``server.common.field_policy``).
    unknown_fields: UnknownFieldsPolicy = "reject"
    #: Whether chat answers get their ``<think>`` part split out (``server.common.reasoning``).
    reasoning_parser: ReasoningParserName = "auto"
    #: How the model writes tool calls (``server.common.tool_syntax``).
    tool_call_parser: ToolCallParserName = "auto"
    #: Responses API answers kept for ``previous_response_id`` (``responses_store``).
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES


class ServingSection(ConnectionLimits, ConfigSection):
    """The keys of ``serving_config`` every server has: the request time limit, the body size
    limit and the HTTP connection limits (``header_timeout_seconds`` ...)."""

    request_timeout_seconds: RequestTimeoutSeconds = 600.0
    max_request_bytes: MaxRequestBytes = 1_000_000

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The HTTP connection limits alone (what the protocol reads from the app's state)."""
        return ConnectionLimits.of(self)


class ServingConfig(ServingSection):
    """``serving_config`` of the generation servers (CB and SB): the shared keys and the default
    length of an answer."""

    default_max_new_tokens: int = Field(
        default=256, ge=1, description="new tokens when a request does not say"
    )
    unknown_fields: UnknownFieldsPolicy = Field(
        default="reject",
        description="an OpenAI request field this server does not know: reject (400 naming "
        "it, as OpenAI answers) or warn (answered without it; a log line and the "
        "X-Unknown-Fields response header name it)",
    )

    reasoning_parser: ReasoningParserName = Field(
        default="auto",
        description="chat answers' <think> part as 'reasoning_content': auto (when the "
        "model's chat template writes <think>: Qwen3, DeepSeek-R1, QwQ), think (always) or "
        "none (the thought stays in the content)",
    )

    tool_call_parser: ToolCallParserName = Field(
        default="auto",
        description="how the model writes tool calls: hermes (<tool_call> blocks; Qwen, "
        "Hermes, and the fallback prompt), llama3_json (Llama 3.x's JSON calls), mistral "
        "([TOOL_CALLS] and a list), or auto (read from the chat template, else hermes)",
    )
    max_stored_responses: int = Field(
        default=DEFAULT_MAX_STORED_RESPONSES,
        ge=0,
        description="Responses API answers kept in memory for previous_response_id and "
        "GET /v1/responses/{id} (the oldest forgotten first)",
    )

    def settings(self, model_id: str) -> ServingSettings:
        """The HTTP layer's settings for a server answering as ``model_id``."""
        return ServingSettings(
            served_model_names=[model_id],
            default_max_new_tokens=self.default_max_new_tokens,
            unknown_fields=self.unknown_fields,
            reasoning_parser=self.reasoning_parser,
            tool_call_parser=self.tool_call_parser,
            max_stored_responses=self.max_stored_responses,
            request_timeout_seconds=self.request_timeout_seconds,
            max_request_bytes=self.max_request_bytes,
            connection_limits=self.connection_limits,
        )


class ServerConfigFile(ConfigSection):
    """Base of a server's whole config file: ``load`` reads it (errors name file and key) and
    remembers where it came from, so that relative paths in it resolve beside it.

    Subclasses set ``env_prefix`` (``LLM_SUITE_..._SERVER``: overrides from the environment)
    and ``file_name`` (the shipped file's name: the origin of a config built in code, whose
    relative paths then resolve against the current directory).
    """

    env_prefix: ClassVar[str]
    file_name: ClassVar[str]

    # Where the config was read from; not part of the JSON.
    _config_file: str | None = PrivateAttr(default=None)

    @property
    def config_file(self) -> str:
        """The file this config came from (relative paths are resolved beside it)."""
        return self._config_file or self.file_name

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read and validate ``path`` (raises ``ConfigError`` naming the file and the key)."""
        config = load_config(path, cls)
        config._config_file = str(path)
        return config


def check_model_folder(
    config_file: str | Path, key: str, folder: str | Path, *, marker: str | None = "config.json"
) -> Path:
    """``folder`` when it is a local folder holding ``marker`` (a Hugging Face model's
    ``config.json`` by default; None: any folder, a tokenizer's say).

    Raises ``ConfigError`` naming the file, the key and the folder otherwise, so that a wrong
    path stops start-up with one line instead of a traceback from transformers.
    """
    path = Path(folder)
    if marker is None:
        if not path.is_dir():
            raise ConfigError(
                f"{config_file}: {key}: '{path}' is not a folder ({_MODEL_FOLDER_HINT})"
            )
    elif not (path / marker).is_file():
        raise ConfigError(
            f"{config_file}: {key}: '{path}' is not a model folder ({marker} missing; "
            f"{_MODEL_FOLDER_HINT})"
        )
    return path
