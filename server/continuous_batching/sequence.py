"""Sequences (one token stream each) and sequence groups (one request: its samples or beams).

Plain Python: the scheduler and block manager only read these fields.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.generation import FinishReason, GenerationConfig

if TYPE_CHECKING:  # annotations only
    from server.continuous_batching.decoding.beam_search import BeamSearchState
    from server.continuous_batching.decoding.row_params import RowLogprobs, RowParams

_seq_ids = itertools.count()


class GroupStatus(enum.Enum):
    """Where a request is in the scheduler's queues."""

    WAITING = "waiting"  # not yet admitted, or preempted by recomputation
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its blocks in the CPU pool
    FINISHED = "finished"


@dataclass
class Sequence:
    """One token stream: the prompt plus what was generated so far, and its KV blocks."""

    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache; the rest must be fed through the model.
    num_computed_tokens: int = 0
    # True while the block table holds CPU-pool blocks (swapped out).
    is_swapped: bool = False
    # Prefix-cache keys of the sequence's full blocks, in order (see block_manager).
    block_keys: list[bytes] = field(default_factory=list)
    # How many leading blocks of the table are registered in the prefix cache.
    num_registered_blocks: int = 0
    # Which choice of the request this sequence is (samples; beams get theirs at the end).
    choice_index: int = 0
    finish_reason: FinishReason | None = None
    # Per-sequence helpers owned by the engine's decoder.
    detokenizer: Any = None
    # Decoding parameters of the sequence's logits row, built on its first step (see decoding).
    row_params: RowParams | None = None
    # Where the sequence is in its output grammar (structured output; a GrammarMatcher of
    # server.common.structured_output), None when unconstrained.
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed through the model before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once the sequence stopped (eos, stop, length or abort)."""
        return self.finish_reason is not None

    def fork(self) -> Sequence:
        """A copy with a new id that shares nothing mutable (blocks are shared by the caller)."""
        return Sequence(
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            block_table=list(self.block_table),
            num_computed_tokens=self.num_computed_tokens,
            block_keys=list(self.block_keys),
            num_registered_blocks=self.num_registered_blocks,
            choice_index=self.choice_index,
            # Each fork follows the grammar on its own from here.
            grammar=self.grammar.fork() if self.grammar is not None else None,
        )


@dataclass
class SequenceGroup:
    """One request: its config and the sequences decoding for it."""

    request_id: str
    seqs: list[Sequence]
    config: GenerationConfig
    arrival_time: float = field(default_factory=time.monotonic)
    status: GroupStatus = GroupStatus.WAITING
    is_aborted: bool = False
    # Token ids that end a sequence (EOS unless ignored, plus stop ids), set once at admission.
    stop_token_ids: list[int] = field(default_factory=list)
    # The token sequences ``config.bad_words`` ban (server.common.bad_words), set at admission.
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # Engine-owned decoding state (sampling generator, beam search state).
    generator: Any = None
    beam_state: BeamSearchState | None = None
    num_preemptions: int = 0
    # The answer's index of this request's first choice: 0, or the choice a resumed stream
    # continues (its seeded draws are keyed by it).
    choice_offset: int = 0
    # With ``config.prompt_logprobs``: entry p scores prompt token p + 1 (filled as the
    # prompt's chunks run), and the choices that were shown them already.
    prompt_logprobs: list[RowLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: set[int] = field(default_factory=set)

    @property
    def is_scoring_prompt(self) -> bool:
        """True when the prompt's own tokens are scored: every position runs the model
        (no prefix-cache hit), and the runner computes their logprobs."""
        return self.config.prompt_logprobs is not None

    def add_prompt_logprobs(self, first_position: int, entries: list[RowLogprobs]) -> None:
        """Record the scores of positions ``first_position...``; positions scored before (a
        prompt recomputed after a preemption) keep their first values."""
        skip = len(self.prompt_logprobs) - first_position
        if skip < 0:
            raise ValueError(
                f"prompt scores from position {first_position} after only "
                f"{len(self.prompt_logprobs)}: a chunk was skipped"
            )
        self.prompt_logprobs.extend(entries[skip:])

    @property
    def num_workload_beams(self) -> int:
        """Sequences this request runs at once when decoding (reserved from admission on)."""
        return max(self.config.num_workload_beams, len(self.live_seqs))

    @property
    def live_seqs(self) -> list[Sequence]:
        """Sequences still generating."""
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_beam_search(self) -> bool:
        """True for beam-search requests."""
        return self.config.is_beam_search

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens any of its sequences may reach."""
        assert self.config.max_new_tokens is not None
        return self.seqs[0].num_prompt_tokens + self.config.max_new_tokens
