"""The processing of a batch's logits, each row by its own :class:`RowParams`.

Processing follows vLLM's sampler (``vllm/v1/sample/sampler.py``) for OpenAI's knobs and
``GenerationMixin._get_logits_processor`` in transformers 5 for Hugging Face's:
``logit_bias``, repetition penalty, frequency and presence penalties (on generated tokens
only), banned ids (``min_new_tokens``, ``bad_words``); then, for sampled rows only,
temperature, ``min_p``, top-k, top-p and typical-p (definitions in
:mod:`server.common.logit_knobs`, HF's transforms in
:mod:`~server.continuous_batching.sampling.logits_processing`). A row that uses none of
OpenAI's knobs gets exactly transformers' processing.

Every transform runs once over all the rows that use it (a masked sub-batch) and is skipped when
no row does, and leaves the rows it does not apply to bit-for-bit intact.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from server.common.logit_knobs import (
    allowed_pairs,
    apply_additive_penalties,
    apply_logit_bias,
    apply_min_p,
    keep_allowed,
)
from server.common.structured_output import allocate_bitmask, apply_bitmask
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.logits_processing import (
    apply_banned_tokens,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)
from server.continuous_batching.step_upload import host_to_device, to_device

__all__ = ["apply_processors", "index_tensor", "process_logits", "select_rows"]


def index_tensor(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` as a long tensor on ``device``, to index a batch's rows with."""
    return to_device(rows, torch.long, device)


def select_rows(logits: torch.Tensor, row_index: list[int]) -> torch.Tensor:
    """The logits rows ``row_index`` (all of them, in order, without a copy when possible)."""
    if row_index == list(range(logits.shape[0])):
        return logits
    return logits[index_tensor(row_index, logits.device)]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    # Python floats are rounded to float32 here exactly as torch rounds HF's scalar operands.
    return to_device(values, torch.float32, device).unsqueeze(1)


def _apply_to_rows(
    scores: torch.Tensor, rows: list[int], transform: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``transform`` the given rows of ``scores`` only (all of them without copying)."""
    if len(rows) == scores.shape[0]:
        return transform(scores)
    index = index_tensor(rows, scores.device)
    scores[index] = transform(scores[index])
    return scores


def _padded_ids(ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """``[r, L]`` long of each row's ids, right-padded with ``vocab_size`` (ids past the
    vocabulary clamped to it, so that they land in the column the ops drop)."""
    # Filled through numpy: a list into a numpy row is some 5x cheaper than a tensor per row
    # (0.08 against 0.46 ms for 32 rows of 128 ids), and this runs every step.
    padded = np.full((len(ids), max(len(x) for x in ids)), vocab_size, dtype=np.int64)
    for j, x in enumerate(ids):
        padded[j, : len(x)] = x
    np.minimum(padded, vocab_size, out=padded)
    return host_to_device(torch.from_numpy(padded), device)


def _add_logit_bias(scores: torch.Tensor, rows: list[RowParams]) -> None:
    """OpenAI's ``logit_bias`` of every row that has one, in one indexed add (in place)."""
    biased = [i for i, row in enumerate(rows) if row.logit_bias]
    if not biased:
        return
    device = scores.device
    row_index = [i for i in biased for _ in rows[i].logit_bias]
    token_index = [t for i in biased for t in rows[i].logit_bias]
    bias = [b for i in biased for b in rows[i].logit_bias.values()]
    apply_logit_bias(
        scores,
        index_tensor(row_index, device),
        index_tensor(token_index, device),
        to_device(bias, torch.float32, device),
    )


def _keep_allowed(scores: torch.Tensor, rows: list[RowParams]) -> None:
    """vLLM's ``allowed_token_ids`` (:func:`keep_allowed`), for the rows that limit them."""
    limited = [i for i, row in enumerate(rows) if row.allowed_token_ids is not None]
    if not limited:
        return
    device = scores.device
    row_ids, token_ids = allowed_pairs(limited, [rows[i].allowed_token_ids or [] for i in limited])
    keep_allowed(
        scores,
        index_tensor(limited, device),
        index_tensor(row_ids, device),
        to_device(token_ids, torch.long, device),
    )


def apply_processors(scores: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """What changes every strategy's choice, in vLLM's order: ``allowed_token_ids``,
    ``logit_bias``, the repetition penalty (HF's), the frequency and presence penalties, then
    the banned ids (``min_new_tokens``' stop ids, ``bad_words``' next tokens)."""
    device, vocab_size = scores.device, scores.shape[-1]
    _keep_allowed(scores, rows)
    _add_logit_bias(scores, rows)
    penalised = [i for i, row in enumerate(rows) if row.penalised]
    if penalised:
        padded = _padded_ids(
            [rows[i].penalty_token_ids or [] for i in penalised], vocab_size, device
        )
        penalty = _column([rows[i].repetition_penalty for i in penalised], device)
        scores = _apply_to_rows(
            scores, penalised, lambda s: apply_repetition_penalty(s, padded, penalty)
        )
    counted = [i for i, row in enumerate(rows) if row.output_penalised]
    if counted:
        # The generated tokens only: the slice past the prompt of the live token list.
        outputs = [(rows[i].penalty_token_ids or [])[rows[i].num_prompt_tokens :] for i in counted]
        generated = _padded_ids(outputs, vocab_size, device)
        frequency = _column([rows[i].frequency_penalty for i in counted], device)
        presence = _column([rows[i].presence_penalty for i in counted], device)
        scores = _apply_to_rows(
            scores,
            counted,
            lambda s: apply_additive_penalties(s, generated, frequency, presence),
        )
    bans = [row.banned_now() for row in rows]
    banned_rows = [i for i, banned in enumerate(bans) for _ in banned]
    if banned_rows:
        banned_ids = [t for banned in bans for t in banned]
        apply_banned_tokens(
            scores, index_tensor(banned_rows, device), index_tensor(banned_ids, device)
        )
    return scores


def _warpers(scores: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Temperature, min-p (vLLM's place for it), top-k, top-p and typical-p, each over the
    sampled rows that use it."""
    device, vocab_size = scores.device, scores.shape[-1]
    sampled = [i for i, row in enumerate(rows) if row.samples]

    hot = [i for i in sampled if rows[i].temperature != 1.0]
    if hot:
        temperature = _column([rows[i].temperature for i in hot], device)
        scores = _apply_to_rows(scores, hot, lambda s: apply_temperature(s, temperature))

    min_p = [i for i in sampled if rows[i].min_p > 0.0]
    if min_p:
        fraction = _column([rows[i].min_p for i in min_p], device)
        scores = _apply_to_rows(scores, min_p, lambda s: apply_min_p(s, fraction))

    top_k = [i for i in sampled if rows[i].top_k > 0]
    if top_k:
        ks = index_tensor([min(max(rows[i].top_k, 1), vocab_size) for i in top_k], device)
        scores = _apply_to_rows(scores, top_k, lambda s: apply_top_k(s, ks))

    top_p = [i for i in sampled if rows[i].top_p < 1.0]
    if top_p:
        one_minus = _column([1.0 - rows[i].top_p for i in top_p], device)
        scores = _apply_to_rows(scores, top_p, lambda s: apply_top_p(s, one_minus))

    typical = [i for i in sampled if rows[i].typical_p < 1.0]
    if typical:
        mass = _column([rows[i].typical_p for i in typical], device)
        scores = _apply_to_rows(scores, typical, lambda s: apply_typical_p(s, mass))
    return scores


def process_logits(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """The scores each row's next token is chosen from: ``[R, V]`` float32, a new tensor.

    Greedy rows get the processors only (HF ignores warpers without ``do_sample``, vLLM takes
    a greedy row's argmax before its temperature); sampled rows also get the warpers. Rows a
    transform does not apply to are left bit-for-bit intact.
    """
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} row parameters")
    scores = logits.to(dtype=torch.float32, copy=True)
    _mask_by_grammar(scores, rows)
    scores = apply_processors(scores, rows)
    return _warpers(scores, rows)


def _mask_by_grammar(scores: torch.Tensor, rows: list[RowParams]) -> None:
    """Structured output: every token a row's grammar does not allow next scores -inf, before
    anything else (so no bias or penalty can bring it back). The masks are computed on the
    host, by llguidance, one row at a time (tens of microseconds each), then applied at once."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return
    # Sized by the tokenizer's vocabulary: logits columns past it (padding) stay masked.
    bitmask = allocate_bitmask(len(constrained), rows[constrained[0]].grammar.vocab_size)
    for j, i in enumerate(constrained):
        rows[i].grammar.fill_bitmask(bitmask, j)
    apply_bitmask(scores, bitmask, constrained)
