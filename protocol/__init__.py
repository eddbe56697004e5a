"""Pydantic v2 models: the wire contract between gateway, servers and users."""

from protocol.errors import ErrorDetail, ErrorResponse
from protocol.generation import (
    ChatMessage,
    Choice,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamChunk,
    GenerationConfig,
    Usage,
)
from protocol.health import HealthResponse, LoadReport
from protocol.openai_api import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)

__all__ = [
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "Choice",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorDetail",
    "ErrorResponse",
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "GenerateStreamChunk",
    "GenerationConfig",
    "HealthResponse",
    "LoadReport",
    "ModelCard",
    "ModelList",
    "Usage",
]
