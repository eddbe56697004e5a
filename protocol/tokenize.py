"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (its ``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``TokenizeResponse``, ``DetokenizeRequest``, ``DetokenizeResponse``).

A tokenize body is a prompt (``prompt``) or a conversation (``messages``, rendered with the
model's chat template as chat completions render it); which one is decided by the field the
body has. Unknown fields are refused with a 400 naming them: a client that sends a field we
would ignore learns it at once.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.generation import ChatMessage

__all__ = [
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeRequest",
    "TokenizeResponse",
]


class TokenizeCompletionRequest(BaseModel):
    """Tokenize a plain prompt (special tokens added as a completion adds them)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(default=True, description="the tokenizer's BOS etc.")
    return_token_strs: bool | None = Field(
        default=False, description="also return each token's string (token_strs)"
    )


class TokenizeChatRequest(BaseModel):
    """Tokenize a conversation rendered with the model's chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = Field(
        default=False, description="the rendered template holds its special tokens already"
    )
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class TokenizeRequest(BaseModel):
    """A ``/tokenize`` body: a prompt or a conversation (the wrapper validates either, so the
    gateway and the servers read the body the same way)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _exactly_one_input(cls, data: object) -> object:
        if isinstance(data, dict) and ("prompt" in data) == ("messages" in data):
            raise ValueError("give exactly one of prompt (text) or messages (a conversation)")
        return data

    def as_request(self) -> TokenizeCompletionRequest | TokenizeChatRequest:
        """The prompt or chat request this body is (validated, unknown fields refused)."""
        data = self.model_dump()
        if "messages" in data:
            return TokenizeChatRequest.model_validate(data)
        return TokenizeCompletionRequest.model_validate(data)


class TokenizeResponse(BaseModel):
    """The token ids (and, when asked, their strings)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """Token ids back to text (special tokens kept, as vLLM's ``/detokenize`` does)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """The text of the ids."""

    prompt: str
