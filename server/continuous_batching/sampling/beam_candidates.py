"""Beam search's one step that needs every log-prob: the best continuations of a request's
beams over every beam and token, as HF computes them; the rest of beam search is plain Python
(:mod:`server.continuous_batching.decoding.beam_search`)."""

from __future__ import annotations

import torch

from server.continuous_batching.decoding.beam_search import BeamCandidate
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.processors import apply_processors
from server.continuous_batching.step_upload import to_device

__all__ = ["beam_log_probs", "top_beam_candidates"]


def beam_log_probs(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Processed log-probabilities of beam rows, as ``_beam_search`` computes them.

    HF takes ``log_softmax`` of the raw logits first and runs the processors (repetition
    penalty, min-new-tokens EOS ban) on the log-probs; beam search uses no warpers.
    """
    log_probs = torch.nn.functional.log_softmax(logits.to(torch.float32), dim=-1)
    return apply_processors(log_probs, rows)


def top_beam_candidates(
    log_probs: torch.Tensor, beam_scores: list[float], k: int
) -> list[BeamCandidate]:
    """HF's ``_get_top_k_continuations``: the ``k`` best (row, token) continuations of a
    request's beams by running score plus log-prob, best first, as plain Python.

    ``log_probs`` are the processed ``[R, V]`` log-probs of the running rows (R = 1 on the
    first step: the prompt stands for every beam, expanded as HF's copies of it), and
    ``beam_scores`` the ``num_beams`` running scores. The sum and the ``topk`` run where the
    log-probs are, with HF's ops, so that the candidates and their tie order are HF's; the
    rest of the beam step is plain Python (:class:`BeamSearchState`).
    """
    num_beams = len(beam_scores)
    num_rows, vocab_size = log_probs.shape
    if num_rows != num_beams and num_rows != 1:
        raise ValueError(f"{num_rows} log-prob rows for {num_beams} beams")
    log_probs = log_probs.to(dtype=torch.float32)
    if num_rows != num_beams:
        # HF runs num_beams copies of the prompt; copies 1.. carry -1e9 and lose.
        log_probs = log_probs.expand(num_beams, -1)
    scores = to_device(beam_scores, torch.float32, log_probs.device)
    accumulated = torch.reshape(log_probs[None] + scores[None, :, None], (1, -1))
    values, indices = torch.topk(accumulated, k=k)
    # One device-to-host copy for both: float64 holds every float32 and every flat index
    # (< 2**53) exactly.
    values_and_indices = torch.cat((values.to(torch.float64), indices.to(torch.float64)))
    host_values, host_indices = values_and_indices.tolist()
    return [
        BeamCandidate(int(index) // vocab_size, int(index) % vocab_size, value)
        for value, index in zip(host_values, host_indices, strict=True)
    ]
