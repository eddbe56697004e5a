"""Next-token selection for a heterogeneous batch: greedy, sampled and beam rows side by side.

:class:`LogitsSampler` is what the decoder calls (its ``TokenSampler``): row indices and
:class:`RowParams` in, plain tokens and beam candidates out. Every row is processed by its own
parameters (:mod:`~server.continuous_batching.sampling.processors`), then chosen or drawn
(:mod:`~server.continuous_batching.sampling.draws`), with the logprobs of the rows that ask
(:mod:`~server.continuous_batching.sampling.logprobs`); beam rows give their best
continuations (:mod:`~server.continuous_batching.sampling.beam_candidates`).
"""

from __future__ import annotations

import torch

from server.continuous_batching.decoding.beam_search import BeamCandidate
from server.continuous_batching.decoding.row_params import RowLogprobs, RowParams
from server.continuous_batching.sampling.beam_candidates import (
    beam_log_probs,
    top_beam_candidates,
)
from server.continuous_batching.sampling.draws import choose, greedy_rows, sample
from server.continuous_batching.sampling.logprobs import SampledTokens, token_logprobs
from server.continuous_batching.sampling.processors import select_rows

__all__ = ["LogitsSampler"]


class LogitsSampler:
    """The decoder's window on the device: it hands over row indices and plain parameters,
    and gets back tokens and beam candidates as plain Python.

    The decoder (:mod:`server.continuous_batching.decoding.decoder`) never touches a tensor;
    every tensor op of the token choice runs here. Plain tokens come in two phases so that the
    engine can overlap: :meth:`sample` queues the choice on the device, :meth:`read_tokens`
    waits for it (the step's one device-to-host sync). A beam group's candidates are read back
    at once (one sync per beam-search request and step).
    """

    def sample(
        self, logits: torch.Tensor, row_index: list[int], params: list[RowParams]
    ) -> torch.Tensor | SampledTokens:
        """The next token of each row ``row_index`` of ``logits``, queued on the device (with
        the logprobs of the rows that ask for them: rows that do not cost nothing more)."""
        if all(row.logprobs is None for row in params):
            if not any(row.processes_logits for row in params):
                return greedy_rows(logits, row_index)
            return sample(select_rows(logits, row_index), params)
        selected = select_rows(logits, row_index)
        need_scores = any(row.logprobs_mode == "processed" for row in params)
        tokens, scores = choose(selected, params, need_scores)
        return SampledTokens(tokens, *token_logprobs(selected, scores, tokens, params))

    def read_tokens(self, tokens: torch.Tensor | SampledTokens) -> list[int]:
        """Tokens queued by :meth:`sample`, read back (their logprobs with them)."""
        if isinstance(tokens, SampledTokens):
            return tokens.read()
        return tokens.tolist()

    def read_logprobs(self, tokens: torch.Tensor | SampledTokens) -> list[RowLogprobs | None]:
        """Per row of a :meth:`read_tokens` handle, its logprobs (None: it did not ask); read
        back with the tokens already, so no further sync."""
        if isinstance(tokens, SampledTokens) and tokens.host is not None:
            return tokens.host
        return [None] * int(tokens.shape[0])

    def beam_candidates(
        self,
        logits: torch.Tensor,
        row_index: list[int],
        params: list[RowParams],
        beam_scores: list[float],
        k: int,
    ) -> list[BeamCandidate]:
        """The ``k`` best continuations of a request's beams (rows ``row_index``), best first
        (see :func:`beam_log_probs` and :func:`top_beam_candidates`)."""
        log_probs = beam_log_probs(select_rows(logits, row_index), params)
        return top_beam_candidates(log_probs, beam_scores, k)
