"""The gateway's request endpoints: one table of paths, each with the model its body is
validated against (the app registers its routes from it, backend kinds compare with it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from protocol.embeddings import EmbeddingRequest
from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest

#: The request bodies the gateway routes.
ParsedRequest = GenerateRequest | CompletionRequest | ChatCompletionRequest | EmbeddingRequest


class Endpoint(StrEnum):
    """A path the gateway forwards (equal to its path string, so it labels metrics as is)."""

    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"

    @property
    def is_openai(self) -> bool:
        """True for the OpenAI API's endpoints (an OpenAI-compatible upstream answers them)."""
        return self in OPENAI_ENDPOINTS

    @property
    def spec(self) -> EndpointSpec:
        """The body model and the OpenAPI summary of this endpoint."""
        return ENDPOINT_SPECS[self]


#: The OpenAI API's endpoints among ours.
OPENAI_ENDPOINTS = frozenset({Endpoint.COMPLETIONS, Endpoint.CHAT, Endpoint.EMBEDDINGS})
#: The endpoints that generate text (every one but embeddings).
GENERATION_ENDPOINTS = frozenset({Endpoint.GENERATE, Endpoint.COMPLETIONS, Endpoint.CHAT})


@dataclass(frozen=True)
class EndpointSpec:
    """What the app needs to register one endpoint."""

    schema: type[ParsedRequest]
    summary: str
    description: str


ENDPOINT_SPECS: dict[Endpoint, EndpointSpec] = {
    Endpoint.GENERATE: EndpointSpec(
        GenerateRequest,
        "Native generation (prompt or messages), streaming or not",
        "Route a native generation request by its ``model``.",
    ),
    Endpoint.COMPLETIONS: EndpointSpec(
        CompletionRequest,
        "OpenAI-compatible text completion",
        "Route an OpenAI completion request by its ``model``.",
    ),
    Endpoint.CHAT: EndpointSpec(
        ChatCompletionRequest,
        "OpenAI-compatible chat completion",
        "Route an OpenAI chat completion request by its ``model``.",
    ),
    Endpoint.EMBEDDINGS: EndpointSpec(
        EmbeddingRequest,
        "OpenAI-compatible embeddings",
        "Route an OpenAI embeddings request by its ``model`` (embedding servers, engines, "
        "jumpers).",
    ),
}
