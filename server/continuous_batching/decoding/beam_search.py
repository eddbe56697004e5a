"""Per-request beam search state reproducing transformers 5's ``GenerationMixin._beam_search``.

The engine owns the model calls and the KV cache; this class owns the beam bookkeeping, in plain
Python over lists and floats. Each step the sampler hands over the request's top candidates,
``(row, token, score)`` triples best first, where ``score`` is the beam's running score plus the
token's processed log-prob (HF's ``_get_top_k_continuations``, the one step that needs the whole
``[num_beams, V]`` log-probs: see
:func:`server.continuous_batching.sampling.beam_candidates.top_beam_candidates`). The state
chooses the beams that keep running, merges finished hypotheses, applies the length penalty and
early stopping, and answers which row each new beam continues and with which token, best first,
so that the engine can fork the block tables (copy-on-write) and append the tokens.

To reproduce HF bit for bit, every score is the float32 HF computes: each sum and quotient is
done in float64 and rounded to float32, which gives the correctly rounded float32 result (a
float64 holds more than twice float32's precision, so the double rounding is exact), as torch's
CPU kernels do; the length penalty's divisor is rounded to float32 first, as torch rounds a
Python scalar operand. The steps are HF's, in HF's order: the ``-1e9`` masking of finished
candidates, the best ``num_beams`` unfinished ones, the merge of new hypotheses into the
finished set, the early-stop heuristic and the done test. Where HF takes a ``topk`` of a few
scores, :func:`~server.continuous_batching.decoding.cpu_topk_order.topk_indices` picks the same
entries in the same order as torch's CPU ``topk``, exact ties included (bfloat16 logits tie
often, and a tie decides which beam lives). The one large ``topk``, over every beam's
vocabulary, runs in torch where the logits are. On a GPU, HF's small ``topk`` and its float32
division (a multiplication by the reciprocal there) may differ from these in the last place or
on ties.

Logits processing is the caller's job, done as HF does it (see
:func:`server.continuous_batching.sampling.beam_candidates.beam_log_probs`): ``log_softmax`` of
the raw logits, then the repetition penalty and, while fewer than ``min_new_tokens`` tokens were
generated, ``-inf`` on the EOS ids (:meth:`BeamSearchState.banned_token_ids` says which), like
HF's ``MinNewTokensLengthLogitsProcessor``.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

from server.continuous_batching.decoding.cpu_topk_order import topk_indices

__all__ = ["BeamCandidate", "BeamSearchState", "float32"]

# HF's "minus infinity" for beam scores: large but finite, so masked scores still order.
_NEG = -1.0e9
_FLOAT32 = struct.Struct("f")


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (ties to even), as torch casts a float64."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:  # beyond float32's range: torch's cast gives an infinity
        return math.copysign(math.inf, value)


def _divide(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` in IEEE arithmetic (Python raises on a zero divisor)."""
    if denominator != 0.0:
        return numerator / denominator
    if numerator == 0.0 or math.isnan(numerator):
        return math.nan
    return math.copysign(math.inf, numerator) * math.copysign(1.0, denominator)


def _length_divisor(length: int, length_penalty: float) -> float:
    """HF's ``length ** length_penalty``: a float64 that torch rounds to float32 as an operand."""
    return float32(length**length_penalty)


class BeamCandidate(NamedTuple):
    """A possible continuation: running row ``row`` extended by ``token``.

    ``score`` is the row's running score plus the token's log-prob, the float32 that HF's
    ``accumulated_log_probs`` holds. On the first step the prompt stands for every row (HF
    runs ``num_beams`` copies of it), so ``row`` may name any copy.
    """

    row: int
    token: int
    score: float


class _Hypothesis(NamedTuple):
    """One slot of the finished set: generated ids, score, and whether a hypothesis ended in
    it (HF's ``is_sent_finished``); an unused slot holds ``((), -1e9, False)``."""

    token_ids: tuple[int, ...]
    score: float
    is_finished: bool


_EMPTY = _Hypothesis((), _NEG, False)


class BeamSearchState:
    """Beam search over one request's beams (HF semantics for every parameter).

    Args:
        num_beams: beams kept alive each step.
        num_return_sequences: how many finished hypotheses :meth:`finished` returns.
        length_penalty: finished scores are divided by ``generated_len ** length_penalty``.
        early_stopping: ``True`` stops once ``num_beams`` hypotheses are finished; ``False``
            stops when the heuristic says no running beam can beat the worst finished one;
            ``"never"`` uses the best score a beam could still reach (HF's canonical variant).
        eos_token_ids: ids that end a hypothesis; empty for ``ignore_eos``.
        num_prompt_tokens: prompt length (only differences of lengths matter).
        max_new_tokens: generation budget; reaching it finishes every candidate.
        min_new_tokens: EOS is banned (by the caller) until this many tokens were generated.
    """

    def __init__(
        self,
        num_beams: int,
        num_return_sequences: int,
        length_penalty: float,
        early_stopping: bool | str,
        eos_token_ids: list[int],
        num_prompt_tokens: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
    ) -> None:
        if num_beams < 1 or not 1 <= num_return_sequences <= num_beams:
            raise ValueError("need 1 <= num_return_sequences <= num_beams")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never': {early_stopping!r}")
        self.num_beams = num_beams
        self.num_return_sequences = num_return_sequences
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_token_ids = list(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self.min_new_tokens = min_new_tokens
        self.max_new_tokens = max_new_tokens
        # HF keeps (1 + n_eos) * num_beams candidates (at least 2x) so that num_beams of them
        # are still running even if the best ones all end with an EOS.
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * num_beams
        # HF's cur_len / decoder_prompt_len / max_length, kept so the float arithmetic of the
        # length penalty and the heuristic is literally HF's.
        self._prompt_len = num_prompt_tokens
        self._cur_len = num_prompt_tokens
        self._max_length = num_prompt_tokens + max_new_tokens
        # Generated ids of each running beam; at first every row is a copy of the prompt.
        self._running: list[list[int]] = [[] for _ in range(num_beams)]
        # Only beam 0 is live at first, so the first step expands the prompt once, not B times.
        self._running_scores = [0.0] + [_NEG] * (num_beams - 1)
        self._finished = [_EMPTY] * num_beams
        self._heuristic_unsatisfied = True
        self.is_done = False

    @property
    def num_generated(self) -> int:
        """Tokens generated so far by every running beam."""
        return self._cur_len - self._prompt_len

    @property
    def num_running(self) -> int:
        """Rows the next step scores: 1 (the prompt) at first, then ``num_beams``."""
        return 1 if self.num_generated == 0 else self.num_beams

    @property
    def running_scores(self) -> list[float]:
        """Each running beam's score (float32 values), ``num_beams`` of them even on the first
        step, where rows 1.. are copies of the prompt scored ``-1e9`` (they lose)."""
        return list(self._running_scores)

    def banned_token_ids(self) -> list[int]:
        """Ids to score ``-inf`` this step: the EOS ids while under ``min_new_tokens``."""
        return list(self.eos_token_ids) if self.num_generated < self.min_new_tokens else []

    def running_token_ids(self) -> list[list[int]]:
        """Generated ids of each running beam (row order of the next step)."""
        return [list(tokens) for tokens in self._running[: self.num_running]]

    def step(self, candidates: list[BeamCandidate]) -> list[tuple[int, int]]:
        """Advance one token.

        Args:
            candidates: the :attr:`num_candidates` best continuations over every running row
                (HF's ``topk`` of the accumulated scores), best first.

        Returns:
            The new running beams as ``(parent_row, token_id)``, best first (``num_beams``).
            Meaningless once :attr:`is_done` turns true, which the caller must check.
        """
        if self.is_done:
            raise RuntimeError("beam search is already done")
        if len(candidates) != self.num_candidates:
            raise ValueError(f"expected {self.num_candidates} candidates, got {len(candidates)}")
        generated = self.num_generated
        # d. stopping criteria per candidate: max length (all of them) or an EOS id.
        is_last = self._cur_len + 1 >= self._max_length
        hits = [is_last or c.token in self._eos for c in candidates]
        # e. the best num_beams unfinished candidates keep running (HF adds -1e9 to the rest).
        masked = [
            float32(c.score + _NEG) if hit else c.score
            for c, hit in zip(candidates, hits, strict=True)
        ]
        chosen = topk_indices(masked, self.num_beams)
        parents = self._running
        self._running = [[*parents[candidates[i].row], candidates[i].token] for i in chosen]
        self._running_scores = [masked[i] for i in chosen]

        self._update_finished(parents, candidates, hits)
        self._cur_len += 1
        self._update_done(hits)
        # The first step's parents all copy the single prompt row.
        return [(0 if generated == 0 else candidates[i].row, candidates[i].token) for i in chosen]

    def _update_finished(
        self, parents: list[list[int]], candidates: list[BeamCandidate], hits: list[bool]
    ) -> None:
        """f. merge new hypotheses into the finished set (HF's ``_update_finished_beams``)."""
        num_beams = self.num_beams
        divisor = _length_divisor(self._cur_len + 1 - self._prompt_len, self.length_penalty)
        # HF's batch-wide masks: nothing finishes into a full set under early_stopping=True,
        # nor once the heuristic is satisfied (a single request is done by then anyway).
        is_full = self.early_stopping is True and all(h.is_finished for h in self._finished)
        scores: list[float] = []
        just_finished: list[bool] = []
        for index, (candidate, hit) in enumerate(zip(candidates, hits, strict=True)):
            # Only candidates ranked in the top num_beams may finish; the rest are spares.
            finishes = hit and index < num_beams
            score = float32(_divide(candidate.score, divisor))
            if is_full:
                score = float32(score + _NEG)
            if not self._heuristic_unsatisfied:
                score = float32(score + _NEG)
            if not finishes:
                score = float32(score + _NEG)
            scores.append(score)
            just_finished.append(finishes)
        merged = [h.score for h in self._finished] + scores
        kept = []
        for i in topk_indices(merged, num_beams):
            if i < num_beams:
                kept.append(self._finished[i])
                continue
            candidate = candidates[i - num_beams]
            token_ids = (*parents[candidate.row], candidate.token)
            kept.append(_Hypothesis(token_ids, merged[i], just_finished[i - num_beams]))
        self._finished = kept

    def _update_done(self, hits: list[bool]) -> None:
        """g. update the early-stop heuristic, then decide whether the search is done.

        HF's ``_check_early_stop_heuristic`` followed by ``_beam_search_has_unfinished_sequences``.
        """
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            # A positive penalty favours length: the best a beam can do is at max length.
            best_hypothetical_length = self._max_length - self._prompt_len
        else:
            best_hypothetical_length = self._cur_len - self._prompt_len
        divisor = _length_divisor(best_hypothetical_length, self.length_penalty)
        best_possible_running_score = float32(_divide(self._running_scores[0], divisor))
        worst_finished_score = min(h.score for h in self._finished)
        self._heuristic_unsatisfied = self._heuristic_unsatisfied and any(
            best_possible_running_score > (worst_finished_score if h.is_finished else _NEG)
            for h in self._finished
        )
        all_finished = all(h.is_finished for h in self._finished)
        exists_open_beam = not (all_finished and self.early_stopping is True)
        valid_continuations = not all(hits)
        self.is_done = not (
            self._heuristic_unsatisfied and exists_open_beam and valid_continuations
        )

    def finished(self) -> list[tuple[list[int], float]]:
        """The ``num_return_sequences`` best hypotheses, best first: (generated ids, score).

        Ids include the EOS the hypothesis ended with. Scores are HF's ``sequences_scores``
        (sum of log-probs divided by ``generated_len ** length_penalty``). A slot that never
        received a hypothesis (HF returns the prompt padded) comes back as ``([], -1e9)``.
        """
        return [(list(h.token_ids), h.score) for h in self._finished[: self.num_return_sequences]]
