"""What the decoder's phases hand each other and the engine, and the sampler it drives.

:meth:`~server.continuous_batching.decoding.decoder.Decoder.launch` returns a :class:`SampledStep`
(tokens queued on the device), :meth:`~server.continuous_batching.decoding.decoder.Decoder.collect`
a :class:`StepTokens` (tokens appended, text still to make), and every phase gives the engine
one :class:`RequestOutput` per request. :class:`TokenSampler` is the decoder's one way to the
logits: row indices and :class:`RowParams` in, plain tokens and beam candidates out
(:class:`server.continuous_batching.sampling.sampler.LogitsSampler` in the engine).

Plain data: no tensors (the logits and the queued tokens pass through as opaque handles), and
no torch import, not even for annotations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from server.common.backend import TextDelta
from server.continuous_batching.decoding.beam_search import BeamCandidate
from server.continuous_batching.decoding.row_params import RowLogprobs, RowParams
from server.continuous_batching.sequence import Sequence, SequenceGroup

__all__ = [
    "GroupRows",
    "Logits",
    "GroupTokens",
    "PreparedRows",
    "RequestOutput",
    "SampledStep",
    "StepTokens",
    "TokenSampler",
]


#: A step's logits (``[R, V]``, a ``torch.Tensor`` in the engine), opaque here: the decoder only
#: hands them to its :class:`TokenSampler`, so the room annotates them without importing torch.
Logits = Any


class TokenSampler(Protocol):
    """The token choice on the device, as the decoder sees it: rows in, plain Python out."""

    def sample(self, logits: Logits, row_index: list[int], params: list[RowParams]) -> Any:
        """Queue the next token of each row ``row_index`` of ``logits``; a handle comes back."""

    def read_tokens(self, tokens: Any) -> list[int]:
        """The tokens a :meth:`sample` handle stands for (waits for the device)."""

    def read_logprobs(self, tokens: Any) -> list[RowLogprobs | None]:
        """Per row of a handle :meth:`read_tokens` read, its logprobs (None where the row
        did not ask); called only when a row asked, after :meth:`read_tokens`, no sync."""

    def beam_candidates(
        self,
        logits: Logits,
        row_index: list[int],
        params: list[RowParams],
        beam_scores: list[float],
        k: int,
    ) -> list[BeamCandidate]:
        """The ``k`` best continuations of one request's beams (rows ``row_index``)."""


@dataclass
class RequestOutput:
    """What one step produced for one request (``error``: it failed alone, and is over)."""

    request_id: str
    deltas: list[TextDelta] = field(default_factory=list)
    is_finished: bool = False
    error: str | None = None


@dataclass
class GroupRows:
    """The logits rows of one sampling group and the sequences they belong to."""

    group: SequenceGroup
    seqs: list[Sequence]
    rows: list[int] = field(default_factory=list)


@dataclass
class PreparedRows:
    """One plain group ready to sample: its logits rows, their parameters, their sequences."""

    entry: GroupRows
    row_index: list[int]
    params: list[RowParams]
    seqs: list[Sequence]


@dataclass
class SampledStep:
    """A step's token choice queued on the device, not read back yet (``Decoder.launch``)."""

    #: Plain groups and their tokens' handle: one for all, or one per group after a failure.
    batches: list[tuple[list[PreparedRows], Any]]
    #: Ready now: beam-search steps (they sync on their own) and failed requests.
    outputs: list[RequestOutput]


@dataclass
class GroupTokens:
    """One group's new tokens of a step, appended to their sequences, text still to make."""

    group: SequenceGroup
    tokens: list[tuple[Sequence, int]]
    #: Aligned with ``tokens`` when a row of the step asked for logprobs, else empty.
    logprobs: list[RowLogprobs | None] = field(default_factory=list)


@dataclass
class StepTokens:
    """A step's tokens read back and appended (``Decoder.collect``)."""

    groups: list[GroupTokens] = field(default_factory=list)
    #: Beam-search steps and failed requests: outputs without text to make.
    outputs: list[RequestOutput] = field(default_factory=list)
    #: Groups whose every sequence ended on a stop id or its length: nothing more to schedule.
    finished: list[SequenceGroup] = field(default_factory=list)

    def drop(self, group: SequenceGroup) -> None:
        """Forget ``group``'s pending text (it was aborted)."""
        self.groups = [entry for entry in self.groups if entry.group is not group]
