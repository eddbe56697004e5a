"""The embedding server's request handling: checks, tokenisation, batching, the answer.

Every check a caller can fail answers 400 naming the field (``input[3]``, ``dimensions``,
``model`` gets 404), before anything is queued: a request is embedded whole or not at all.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from protocol.embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from protocol.health import LoadReport
from server.common.metrics import EmbeddingMetrics
from server.embedding.batcher import EmbeddingBatcher
from server.embedding.config import EmbeddingLimits
from server.embedding.encoder import Encoder
from utils.errors import APIError


class EmbeddingService:
    """Turns one ``/v1/embeddings`` request into vectors with the shared batcher."""

    def __init__(
        self,
        encoder: Encoder,
        batcher: EmbeddingBatcher,
        limits: EmbeddingLimits,
        model_id: str,
        metrics: EmbeddingMetrics,
    ) -> None:
        self.encoder = encoder
        self.batcher = batcher
        self.limits = limits
        self.model_id = model_id
        self.metrics = metrics
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="embedding-tokenizer")
        configured = limits.max_tokens_per_input
        #: Most tokens (special tokens included) one input may have.
        self.max_tokens = min(configured or encoder.max_tokens, encoder.max_tokens)

    async def start(self) -> None:
        """Start batching (the app's lifespan calls this inside the event loop)."""
        self.batcher.start()

    async def shutdown(self) -> None:
        """Stop batching; inputs still waiting fail."""
        await self.batcher.stop()

    def load_report(self) -> LoadReport:
        """Inputs waiting for and inside a forward pass."""
        return LoadReport(
            num_waiting=self.batcher.num_waiting, num_running=self.batcher.num_running
        )

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """The answer for ``request``; raises :class:`APIError` for what cannot be embedded."""
        self._check(request)
        # Tokenising up to 2048 texts takes a while: off the event loop, which keeps
        # answering health checks and other requests meanwhile. One thread: a Rust tokenizer
        # shared by concurrent calls can fail ("Already borrowed").
        loop = asyncio.get_running_loop()
        inputs = await loop.run_in_executor(self._tokenizing, self._all_token_ids, request)
        futures = self.batcher.submit(inputs)
        try:
            vectors = await asyncio.wait_for(
                asyncio.gather(*futures), timeout=self.limits.request_timeout_seconds
            )
        except TimeoutError:
            raise APIError(
                504, f"embedding took longer than {self.limits.request_timeout_seconds} s"
            ) from None
        finally:
            for future in futures:  # a caller that left frees its places in the queue
                future.cancel()
        num_tokens = sum(len(ids) for ids in inputs)
        self.metrics.observe(len(inputs), num_tokens)
        data = [
            EmbeddingData(index=index, embedding=_encoded(vector, request.encoding_format))
            for index, vector in enumerate(vectors)
        ]
        return EmbeddingResponse(
            data=data,
            model=self.model_id,
            usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )

    def _check(self, request: EmbeddingRequest) -> None:
        if request.model and request.model != self.model_id:
            raise APIError(
                404,
                f"model {request.model!r} is not served here; available: {self.model_id!r}",
                param="model",
            )
        if request.dimensions is not None and request.dimensions != self.encoder.dimension:
            # MiniLM-style models are not trained to be cut (Matryoshka): only the full size.
            raise APIError(
                400,
                f"dimensions: model {self.model_id!r} makes {self.encoder.dimension}-dimensional "
                f"vectors and cannot shorten them (got {request.dimensions})",
                param="dimensions",
            )
        num_inputs, limit = len(request.inputs), self.limits.max_inputs_per_request
        if num_inputs > limit:
            raise APIError(
                400, f"input: {num_inputs} inputs, at most {limit} per request", param="input"
            )

    def _all_token_ids(self, request: EmbeddingRequest) -> list[list[int]]:
        """Every input as ids with special tokens (texts tokenised in one batch call)."""
        items = request.inputs
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(self.encoder.batch_token_ids(texts) if texts else [])
        return [
            self._token_ids(index, next(encoded) if isinstance(item, str) else item, request)
            for index, item in enumerate(items)
        ]

    def _token_ids(self, index: int, ids: list[int], request: EmbeddingRequest) -> list[int]:
        """Input ``index`` as ids with special tokens: checked, and cut only when asked."""
        bad = [t for t in ids if not 0 <= t < self.encoder.vocab_size]
        if bad:
            raise APIError(
                400,
                f"input[{index}]: token id {bad[0]} is outside the vocabulary "
                f"(0..{self.encoder.vocab_size - 1})",
                param=f"input[{index}]",
            )
        room = self.max_tokens - self.encoder.num_special_tokens
        truncate = request.truncate_prompt_tokens
        if truncate is not None:
            # Keep the beginning, as sentence-transformers does when it truncates.
            keep = room if truncate == -1 else min(truncate - self.encoder.num_special_tokens, room)
            ids = ids[: max(keep, 1)]
        elif len(ids) > room:
            raise APIError(
                400,
                f"input[{index}] has {len(ids) + self.encoder.num_special_tokens} tokens, more "
                f"than the {self.max_tokens} this model takes per input (set "
                "truncate_prompt_tokens to cut it)",
                param=f"input[{index}]",
            )
        return self.encoder.with_specials(list(ids))


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """The vector as floats, or as OpenAI's base64 (little-endian float32 bytes)."""
    values = vector.to(torch.float32).contiguous()
    if encoding_format == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
    return values.tolist()


def new_embedding_id() -> str:
    """An id for the request log line."""
    return f"embd-{uuid.uuid4().hex}"
