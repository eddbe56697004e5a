"""OpenAI-compatible API models: completions, chat completions, stream chunks, model list.

The request bodies are in ``request_models`` (what they accept, what they refuse, and that
unknown fields are dropped), the answers in ``response_models``; both are importable from here.
"""

from __future__ import annotations

# The chat message and usage are protocol.generation's; importers found them here before.
from protocol.generation import ChatMessage, Usage
from protocol.openai_api.request_models import (
    MAX_COMPLETION_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
)
from protocol.openai_api.request_parts import (
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    Tool,
    ToolChoiceFunction,
)
from protocol.openai_api.response_models import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    OpenAIFinishReason,
    PromptLogprob,
    ToolCall,
)

__all__ = [
    "ChatMessage",
    "Usage",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatLogprobs",
    "ChatResponseMessage",
    "ChatTokenLogprob",
    "ChatTopLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "PromptLogprob",
    "CompletionRequest",
    "CompletionResponse",
    "FunctionCall",
    "FunctionDefinition",
    "JsonSchemaFormat",
    "MAX_COMPLETION_LOGPROBS",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "OpenAIFinishReason",
    "ResponseFormat",
    "StreamOptions",
    "Tool",
    "ToolCall",
    "ToolChoiceFunction",
]
