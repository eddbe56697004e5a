"""A caller's Triton generate request as the gateway routes it: the parsed body, the model
named in the path, and which of the two endpoints it came on."""

from __future__ import annotations

from dataclasses import dataclass

from client.triton.protocol import TritonGenerateRequest
from protocol.generation import GenerateRequest


@dataclass(frozen=True)
class TritonCall:
    """``POST /v2/models/{model_name}/generate[_stream]`` with its body, parsed once."""

    request: TritonGenerateRequest
    #: The model as the caller named it in the path.
    model_name: str
    #: The gateway model that name stands for (None: any, e.g. TensorRT-LLM's "ensemble").
    model: str | None
    is_stream_endpoint: bool

    @property
    def stream(self) -> bool:
        """True when the answer streams deltas: ``generate_stream`` with ``"stream": true``
        (without it TensorRT-LLM sends the whole text as one event)."""
        return self.is_stream_endpoint and self.request.stream

    def to_generate_request(self) -> GenerateRequest:
        """The native request that asks the same."""
        return self.request.to_generate_request(
            self.model, streaming_endpoint=self.is_stream_endpoint
        )

    def path_for(self, triton_model: str) -> str:
        """This call's path on a Triton server that names the model ``triton_model``."""
        endpoint = "generate_stream" if self.is_stream_endpoint else "generate"
        return f"/v2/models/{triton_model}/{endpoint}"
