"""The gateway config's keys for Triton: the Triton servers behind it (listed, or found
through DNS) and the model names Triton callers use on the gateway."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from client.config.schema_common import BaseURL, ServerDNSConfig


class TritonServerConfig(BaseModel):
    """One Triton Inference Server (e.g. with TensorRT-LLM) behind the gateway."""

    model_config = ConfigDict(extra="forbid")

    url: BaseURL
    models: dict[str, str] = Field(
        min_length=1,
        description="gateway model id -> Triton model name (TensorRT-LLM: usually 'ensemble')",
    )
    default_max_tokens: int = Field(
        default=256, ge=1, description="max_tokens sent when a request sets none (Triton needs one)"
    )
    chat_template_from: str | None = Field(
        default=None,
        description="a Hugging Face tokenizer folder whose chat template renders chat requests "
        "into text for this server (without it, chats never go there)",
    )


class TritonServerDNSConfig(ServerDNSConfig):
    """Triton servers found through DNS; every address gets the same model names."""

    models: dict[str, str] = Field(min_length=1)
    default_max_tokens: int = Field(default=256, ge=1)
    chat_template_from: str | None = None

    def server_config(self, url: str) -> TritonServerConfig:
        """The entry of one discovered Triton server at ``url``."""
        fields = self.model_dump(exclude={"name", "port", "scheme"})
        return TritonServerConfig(url=url, **fields)


class TritonSection(BaseModel):
    """The gateway config's keys for Triton servers (and for Triton callers' model names)."""

    triton_server_urls: list[TritonServerConfig] = Field(default_factory=list)
    triton_server_dns: TritonServerDNSConfig | None = None
    triton_model_aliases: dict[str, str] = Field(
        default_factory=lambda: {"ensemble": ""},
        description="Triton API on the gateway: model names clients use -> gateway model id "
        "('' = any model); a Triton + TensorRT-LLM client calls its model 'ensemble'",
    )
