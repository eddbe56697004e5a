"""OpenAI's embeddings API (``POST /v1/embeddings``): request, answer, and the one rule that
turns ``input`` into a list of inputs.

``input`` is a string, a list of strings, a list of token ids (one input) or a list of lists
of token ids, as in the OpenAI API. Empty inputs are refused (OpenAI refuses them too): an
empty string has no meaning to embed. ``truncate_prompt_tokens`` (vLLM's name) asks for
inputs longer than that (``-1``: longer than the model takes) to be cut instead of refused.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from protocol.generation import TruncatePromptTokens

#: One input: a text, or the token ids of a text (without the model's special tokens).
EmbeddingInput = StrictStr | list[StrictInt]
#: Most inputs one request may carry, as in OpenAI's API (a server may set a lower limit).
MAX_INPUTS_PER_REQUEST = 2048


class EmbeddingRequest(BaseModel):
    """Body of ``POST /v1/embeddings``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Annotated[
        StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]],
        Field(union_mode="left_to_right"),
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extra: cut inputs past this many tokens instead of refusing them (-1: the model's
    # maximum).
    truncate_prompt_tokens: TruncatePromptTokens = None

    @field_validator("input")
    @classmethod
    def _check_input(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        inputs = as_inputs(value)
        if not inputs:
            raise ValueError("must not be empty")
        if len(inputs) > MAX_INPUTS_PER_REQUEST:
            raise ValueError(f"at most {MAX_INPUTS_PER_REQUEST} inputs per request")
        for index, item in enumerate(inputs):
            if len(item) == 0:
                raise ValueError(f"input {index} is empty")
        return value

    @property
    def inputs(self) -> list[EmbeddingInput]:
        """``input`` as a list with one entry per input."""
        return as_inputs(self.input)

    # What the gateway asks of every request it routes.
    @property
    def stream(self) -> bool:
        """Embeddings are never streamed."""
        return False

    def to_generate_request(self) -> None:
        """No native generation request asks the same."""
        return None


def as_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[EmbeddingInput]:
    """One entry per input: a lone string or a flat list of token ids is one input."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    """One vector of the answer (``embedding`` is base64 of little-endian float32 when asked)."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of an embeddings answer (inputs only: nothing is generated)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """Answer of ``POST /v1/embeddings``."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
