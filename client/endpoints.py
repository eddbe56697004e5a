"""The gateway's request endpoints: one table of paths and the API each belongs to, with the
model the JSON endpoints' bodies are validated against (the app registers their routes from it;
backend kinds compare with it)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from client.routing_fields import RoutingFields
from client.triton.call import TritonCall
from protocol.embeddings import EmbeddingRequest
from protocol.generation import GenerateRequest
from protocol.openai_api import ChatCompletionRequest, CompletionRequest
from protocol.openai_api.responses_models import ResponsesRequest
from protocol.tokenize import DetokenizeRequest, TokenizeRequest

#: What the gateway parses of a request: the routing fields of a JSON body, a Triton call; or,
#: built in code, a whole request model.
ParsedRequest = (
    RoutingFields
    | TritonCall
    | GenerateRequest
    | CompletionRequest
    | ChatCompletionRequest
    | EmbeddingRequest
)
#: The APIs callers and backends speak.
Api = Literal["native", "openai", "triton"]


class Endpoint(StrEnum):
    """A path the gateway forwards (equal to its path string, so it labels metrics as is)."""

    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    RESPONSES = "/v1/responses"
    EMBEDDINGS = "/v1/embeddings"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    #: A path listed in an OpenAI-compatible upstream's ``relayed_paths`` (vLLM's ``/v1/rerank``,
    #: ``/v1/score``, ``/pooling`` ...), relayed as it came; the request carries the path.
    RELAYED = "/{relayed_path}"
    TRITON_GENERATE = "/v2/models/{model}/generate"
    TRITON_GENERATE_STREAM = "/v2/models/{model}/generate_stream"

    @property
    def api(self) -> Api:
        """The API this endpoint belongs to (``/tokenize`` and ``/detokenize``: our servers'
        own, in vLLM's shapes)."""
        if self in OPENAI_ENDPOINTS or self == Endpoint.RELAYED:
            return "openai"
        return "native" if self in NATIVE_ENDPOINTS else "triton"

    @property
    def has_native_form(self) -> bool:
        """False where no request can be asked as a native ``/generate`` one (the tokenizer's
        endpoints); elsewhere its parsed body says whether it can."""
        return self not in TOKEN_ENDPOINTS and self not in (Endpoint.RESPONSES, Endpoint.RELAYED)

    @property
    def is_openai(self) -> bool:
        """True for the OpenAI API's endpoints (an OpenAI-compatible upstream answers them)."""
        return self in OPENAI_ENDPOINTS

    @property
    def spec(self) -> EndpointSpec:
        """The body model and the OpenAPI summary of this endpoint."""
        return ENDPOINT_SPECS[self]


#: The OpenAI API's endpoints among ours.
OPENAI_ENDPOINTS: frozenset[Endpoint] = frozenset(
    {Endpoint.COMPLETIONS, Endpoint.CHAT, Endpoint.RESPONSES, Endpoint.EMBEDDINGS}
)
#: Our servers' own endpoints.
NATIVE_ENDPOINTS: frozenset[Endpoint] = frozenset(
    {Endpoint.GENERATE, Endpoint.TOKENIZE, Endpoint.DETOKENIZE}
)
#: The tokenizer's endpoints (no generation: no usage, never a stream).
TOKEN_ENDPOINTS: frozenset[Endpoint] = frozenset({Endpoint.TOKENIZE, Endpoint.DETOKENIZE})
#: The endpoints that generate text.
GENERATION_ENDPOINTS = (
    frozenset(Endpoint) - {Endpoint.EMBEDDINGS, Endpoint.RELAYED} - TOKEN_ENDPOINTS
)


@dataclass(frozen=True)
class EndpointSpec:
    """What the app needs to register one endpoint."""

    schema: type[
        GenerateRequest
        | CompletionRequest
        | ChatCompletionRequest
        | EmbeddingRequest
        | TokenizeRequest
        | DetokenizeRequest
        | ResponsesRequest
    ]
    summary: str
    description: str


#: The JSON endpoints the app registers from this table (Triton's have routes of their own,
#: in ``client.triton.intake``).
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
    Endpoint.RESPONSES: EndpointSpec(
        ResponsesRequest,
        "OpenAI Responses API",
        "Route a Responses API request by its ``model``; one that names a "
        "``previous_response_id`` the gateway relayed goes to the server that stored it.",
    ),
    Endpoint.TOKENIZE: EndpointSpec(
        TokenizeRequest,
        "Token ids of a prompt or a conversation (vLLM's /tokenize)",
        "Route a tokenize request by its ``model`` to one of our servers serving it.",
    ),
    Endpoint.DETOKENIZE: EndpointSpec(
        DetokenizeRequest,
        "Text of token ids (vLLM's /detokenize)",
        "Route a detokenize request by its ``model`` to one of our servers serving it.",
    ),
    Endpoint.EMBEDDINGS: EndpointSpec(
        EmbeddingRequest,
        "OpenAI-compatible embeddings",
        "Route an OpenAI embeddings request by its ``model`` (embedding servers, engines, "
        "jumpers).",
    ),
}
