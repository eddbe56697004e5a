"""The interface between the HTTP layer and a batching engine (static or continuous).

The HTTP layer (``server.common.routes``) turns API requests into ``SequenceRequest`` objects
and consumes the ``TextDelta`` batches that a backend streams back. A backend never sees HTTP.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from protocol.generation import FinishReason, GenerationConfig, TokenLogprob
from protocol.health import ComputePath, LoadReport, ServerKind


@dataclass
class SequenceRequest:
    """One prompt to generate for, already tokenized.

    ``config.max_new_tokens`` is always set (resolved against the context length).
    """

    request_id: str
    prompt_token_ids: list[int]
    config: GenerationConfig
    arrival_time: float = field(default_factory=time.monotonic)
    #: For ``config.json_schema``: a matcher at the start of its grammar
    #: (``server.common.structured_output.GrammarMatcher``), None when unconstrained.
    grammar: Any = None
    #: For ``config.bad_words``: the token sequences they ban (``server.common.bad_words``).
    bad_words_ids: list[list[int]] = field(default_factory=list)
    #: A resumed stream (``protocol.resume``): the tokens another server generated for this
    #: choice before it died, continued here as if generated here (one choice, n = 1).
    resumed_token_ids: list[int] = field(default_factory=list)
    #: Characters of their text the caller already has (the rest was held back).
    num_resumed_text_chars: int = 0
    #: The answer's index of the choice (keys its seeded draws).
    choice_index: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt in tokens."""
        return len(self.prompt_token_ids)


@dataclass
class TextDelta:
    """New output of one choice of a request.

    ``text`` is the new text since the previous delta of that choice (may be empty),
    ``num_new_tokens`` the tokens it came from; ``finish_reason`` is set on the last delta
    of the choice, which may also carry text. ``logprobs``, when the request asked for them,
    has one entry per id of ``token_ids``, in order: they follow the tokens, not the text
    (which the detokenizer may hold back for a later delta).
    """

    index: int
    text: str
    num_new_tokens: int
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    #: On a choice's first delta when the request scores its prompt
    #: (``config.prompt_logprobs``): one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None


class GenerationBackend(abc.ABC):
    """A loaded model plus its batching engine, seen from the HTTP layer."""

    kind: ServerKind
    model_id: str
    max_model_len: int
    tokenizer: Any
    #: What computes the model (device, CPU ISA level), for /health and /metrics.
    compute_path: ComputePath | None = None
    #: True when the engine masks each row by its output grammar (``json_schema``).
    is_structured_output_supported: bool = False
    #: True when the engine gives each token's logprobs (``generation_config.logprobs``).
    is_logprobs_supported: bool = False
    #: True when waiting requests are admitted by ``GenerationConfig.priority``.
    is_priority_supported: bool = False

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the engine's background work (called once, inside the event loop)."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine; requests still running end with finish_reason "abort"."""

    @abc.abstractmethod
    def stream(self, request: SequenceRequest) -> AsyncIterator[list[TextDelta]]:
        """Generate for ``request``, yielding batches of deltas until every choice finished.

        Closing the iterator early (client gone, timeout) aborts the request and frees
        whatever it held. Raises ``utils.errors.APIError`` for refusals (overload: 503).
        """

    @abc.abstractmethod
    def load_report(self) -> LoadReport:
        """Current queue and cache figures for ``GET /health``."""

    def counters(self) -> dict[str, float]:
        """Monotonic engine counters for ``/metrics`` (name -> value); none by default."""
        return {}
