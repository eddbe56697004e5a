"""A call's work as the servers track it: its sequence requests (one per prompt), how their
choices number in the answer, and each choice's accumulated output."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.generation import FinishReason, TokenLogprob, Usage
from server.common.backend import SequenceRequest
from server.common.request_context import RequestRecord


@dataclass
class ChoiceResult:
    """The accumulated output of one choice."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    #: One entry per generated token when the request asked for logprobs, else None.
    logprobs: list[TokenLogprob] | None = None
    #: One entry per prompt token after the first when the request scores its prompt.
    prompt_logprobs: list[TokenLogprob] | None = None
    #: The generated token ids.
    token_ids: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The whole generated text of the choice."""
        return "".join(self.text_parts)


@dataclass
class Job:
    """The sequence requests that one API call expands into (one per prompt)."""

    request_id: str
    sequences: list[SequenceRequest]
    num_choices_per_sequence: int
    # The call's closing log line, filled in as the deltas come.
    record: RequestRecord
    #: The generated tokens are not part of the answer (``echo`` with ``max_tokens`` 0):
    #: they are not counted as completion tokens either.
    is_output_dropped: bool = False
    #: The answer's index of each sequence's first choice (None: sequence i, choice j ->
    #: i * n + j).
    choice_offsets: list[int] | None = None
    #: A resumed stream: its answer's creation time, the choices its stream opened already,
    #: and the completion tokens streamed before (usage counts them).
    created: int | None = None
    opened_choices: set[int] = field(default_factory=set)
    num_earlier_completion_tokens: int = 0

    @property
    def is_resumable(self) -> bool:
        """True when another server could finish this job's stream from its token ids: one
        prompt, and no beam search (a beam is chosen at the end, not token by token)."""
        is_one_prompt = len(self.sequences) == 1 or self.choice_offsets is not None
        return is_one_prompt and not self.sequences[0].config.is_beam_search

    def offset_of(self, sequence_index: int) -> int:
        """The answer's index of sequence ``sequence_index``'s first choice."""
        if self.choice_offsets is not None:
            return self.choice_offsets[sequence_index]
        return sequence_index * self.num_choices_per_sequence

    def prompt_token_ids_of(self, choice_index: int) -> list[int]:
        """The prompt's token ids of the answer's choice ``choice_index``."""
        if self.choice_offsets is not None:  # a resumed stream's choices share one prompt
            return self.sequences[0].prompt_token_ids
        return self.sequences[choice_index // self.num_choices_per_sequence].prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over all prompts of the call (a resumed stream's choices share one)."""
        if self.choice_offsets is not None:
            return self.sequences[0].num_prompt_tokens
        return sum(s.num_prompt_tokens for s in self.sequences)

    def usage(self, num_completion_tokens: int) -> Usage:
        """Usage figures for the call."""
        if self.is_output_dropped:
            num_completion_tokens = 0
        num_completion_tokens += self.num_earlier_completion_tokens
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=self.num_prompt_tokens + num_completion_tokens,
        )
