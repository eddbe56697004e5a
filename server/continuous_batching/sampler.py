"""Next-token selection for a heterogeneous batch: greedy and sampled rows side by side.

One :func:`sample` call per engine step covers every row that needs a token, each row with its
own :class:`RowParams`. Processing follows vLLM's sampler (``vllm/v1/sample/sampler.py``) for
OpenAI's knobs and ``GenerationMixin._get_logits_processor`` in transformers 5 for Hugging
Face's: ``logit_bias``, repetition penalty, frequency and presence penalties (on generated
tokens only), banned ids (``min_new_tokens``); then, for sampled rows only, temperature,
``min_p``, top-k, top-p and typical-p (definitions in :mod:`server.common.logit_knobs`).
Greedy rows take the argmax of the processed scores, sampled rows draw from their softmax. A
row that uses none of OpenAI's knobs gets exactly transformers' processing.

Every transform runs once over all the rows that use it (a masked sub-batch) and is skipped when
no row does, so an all-greedy batch without penalties costs a single ``argmax``; in a mixed
batch only the rows that process their logits are copied and processed, the plain greedy rows
take their argmax alone (``_choose``; ``_choose_all`` is the reference that processes all).

Reproducibility: a sampled row draws its randomness from its own ``torch.Generator`` with the
"exponential race" ``argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d. per token, which picks token
``i`` with probability ``probs[i]`` (same law as ``torch.multinomial``). A row consumes exactly
``V`` exponentials from its generator per step, whatever else is batched, so a seeded request
gives the same tokens alone or in any batch. The engine's seeded rows carry a ``draw_key``
instead (:mod:`server.continuous_batching.draw_keys`): their draw seeds a generator afresh
from the seed, the choice and the position, so that a stream resumed on another server draws
the same. The draws differ from ``generate``'s multinomial,
so the samples are not those transformers would draw for the same seed.

Beam search takes its log-probs here too (:func:`beam_log_probs`), and the one beam step that
needs all of them, the best continuations over every beam and token
(:func:`top_beam_candidates`); the rest of beam search is plain Python. :class:`LogitsSampler`
is what the decoder calls: row indices and parameters in, plain tokens and candidates out.

Logprobs (:func:`token_logprobs`): for the rows that ask (``RowParams.logprobs``) and only
those, ``log_softmax`` in float32 of the raw logits, or of the processed scores the token was
chosen from (``logprobs_mode`` ``"processed"``), gathered at the chosen token, with the top-N;
they come back with the tokens in the step's one device-to-host copy (:class:`SampledTokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from server.common.logit_knobs import apply_additive_penalties, apply_logit_bias, apply_min_p
from server.common.structured_output import allocate_bitmask, apply_bitmask
from server.continuous_batching.beam_search import BeamCandidate
from server.continuous_batching.logits_processing import (
    apply_banned_tokens,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    apply_typical_p,
)
from server.continuous_batching.row_params import RowLogprobs, RowParams
from server.continuous_batching.step_upload import host_to_device, to_device

__all__ = [
    "LogitsSampler",
    "RowParams",
    "SampledTokens",
    "beam_log_probs",
    "make_generator",
    "process_logits",
    "sample",
    "select_rows",
    "token_logprobs",
    "top_beam_candidates",
]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``, or ``None`` (global RNG) without a seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return to_device(rows, torch.long, device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    # Python floats are rounded to float32 here exactly as torch rounds HF's scalar operands.
    return to_device(values, torch.float32, device).unsqueeze(1)


def _apply_to_rows(
    scores: torch.Tensor, rows: list[int], transform: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``transform`` the given rows of ``scores`` only (all of them without copying)."""
    if len(rows) == scores.shape[0]:
        return transform(scores)
    index = _index(rows, scores.device)
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
        _index(row_index, device),
        _index(token_index, device),
        to_device(bias, torch.float32, device),
    )


def _processors(scores: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """What changes every strategy's choice, in vLLM's order: ``logit_bias``, the repetition
    penalty (HF's), the frequency and presence penalties, then the banned ids."""
    device, vocab_size = scores.device, scores.shape[-1]
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
    banned_rows = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
    if banned_rows:
        banned_ids = [t for row in rows for t in row.banned_token_ids]
        apply_banned_tokens(scores, _index(banned_rows, device), _index(banned_ids, device))
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
        ks = _index([min(max(rows[i].top_k, 1), vocab_size) for i in top_k], device)
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
    scores = _processors(scores, rows)
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


def beam_log_probs(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Processed log-probabilities of beam rows, as ``_beam_search`` computes them.

    HF takes ``log_softmax`` of the raw logits first and runs the processors (repetition
    penalty, min-new-tokens EOS ban) on the log-probs; beam search uses no warpers.
    """
    log_probs = torch.nn.functional.log_softmax(logits.to(torch.float32), dim=-1)
    return _processors(log_probs, rows)


_KEYED_GENERATORS: dict[torch.device, torch.Generator] = {}


def _keyed_generator(device: torch.device) -> torch.Generator:
    """The one generator of ``device`` that keyed draws reseed before each use."""
    generator = _KEYED_GENERATORS.get(device)
    if generator is None:
        generator = _KEYED_GENERATORS[device] = torch.Generator(device=device)
    return generator


def _exponential_noise(
    shape: tuple[int, int], rows: list[RowParams], device: torch.device
) -> torch.Tensor:
    """``Exp(1)`` noise, row ``j`` drawn from the generator seeded with ``rows[j].draw_key``,
    else from ``rows[j].generator`` (one draw of V per row)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    unseeded = []
    for j, row in enumerate(rows):
        if row.draw_key is not None:  # seeded afresh per draw (see draw_keys)
            generator = _keyed_generator(device)
            generator.manual_seed(row.draw_key)
            noise[j].exponential_(generator=generator)
        elif row.generator is None:
            unseeded.append(j)
        else:
            noise[j].exponential_(generator=row.generator)
    if unseeded:
        noise[_index(unseeded, device)] = torch.empty(
            (len(unseeded), shape[1]), dtype=torch.float32, device=device
        ).exponential_()
    # A draw of exactly 0 would turn a zero probability into 0/0 = NaN, which argmax picks.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _choose(
    logits: torch.Tensor, rows: list[RowParams], need_scores: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token ids ``[R]``, and the processed scores they were chosen from when
    ``need_scores`` (else None; None also when no row processes its logits: the scores are
    the logits then).

    Rows that process nothing (plain greedy) take the argmax of their logits; only the rows
    that do are copied, processed and, if sampled, drawn from, as a sub-batch (no [R, V]
    float32 copy of the whole batch for one penalised row). The tokens are those of
    :func:`_choose_all`, which processes every row: a transform leaves the rows it does not
    apply to bit-for-bit intact, and the sampled rows draw in the same order."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} row parameters")
    processing = [i for i, row in enumerate(rows) if row.processes_logits]
    if not processing:
        return logits.argmax(dim=-1), None
    if len(processing) == len(rows):
        return _choose_all(logits, rows)
    index = _index(processing, logits.device)
    sub_tokens, sub_scores = _choose_all(
        logits.index_select(0, index), [rows[i] for i in processing]
    )
    next_tokens = logits.argmax(dim=-1).index_copy_(0, index, sub_tokens)
    if not need_scores:
        return next_tokens, None
    scores = logits.to(dtype=torch.float32, copy=True).index_copy_(0, index, sub_scores)
    return next_tokens, scores


def _choose_all(logits: torch.Tensor, rows: list[RowParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row through :func:`process_logits`, then argmax or a draw: the reference path."""
    scores = process_logits(logits, rows)
    next_tokens = scores.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.samples]
    if sampled:
        index = _index(sampled, scores.device)
        probs = torch.softmax(scores[index], dim=-1)
        noise = _exponential_noise(tuple(probs.shape), [rows[i] for i in sampled], scores.device)
        next_tokens[index] = (probs / noise).argmax(dim=-1)
    return next_tokens, scores


def sample(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Next token ids ``[R]`` (long) for logits ``[R, V]``, each row by its own parameters."""
    return _choose(logits, rows)[0]


def token_logprobs(
    logits: torch.Tensor,
    scores: torch.Tensor | None,
    tokens: torch.Tensor,
    rows: list[RowParams],
) -> tuple[list[int], list[int], torch.Tensor]:
    """The logprobs of the rows that ask for them, still on the device.

    Returns the positions of those rows, their top-N counts, and a float32 table
    ``[len(positions), 1 + 2 * max N]``: the chosen token's logprob, the top-N logprobs (best
    first), then the top-N ids (exact in float32 below 2**24). The log-softmax runs over the
    asking rows only, in float32: of the raw ``logits`` (mode ``"raw"``), or of ``scores``
    (mode ``"processed"``; the logits when ``scores`` is None, as nothing processed them).
    """
    asking = [i for i, row in enumerate(rows) if row.logprobs is not None]
    counts = [rows[i].logprobs or 0 for i in asking]
    device = logits.device
    # Every row asking (the common case of one request alone) needs no gather of rows.
    index = None if len(asking) == logits.shape[0] else _index(asking, device)

    def pick(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if index is None else tensor.index_select(0, index)

    # Never written to in place: the logits serve the step's beam groups after this.
    source = pick(logits).to(torch.float32)
    processed = [rows[i].logprobs_mode == "processed" for i in asking]
    if any(processed) and scores is not None:
        if all(processed):
            source = pick(scores)
        else:
            is_processed = to_device(processed, torch.bool, device).unsqueeze(1)
            source = torch.where(is_processed, pick(scores), source)
    log_probs = torch.log_softmax(source, dim=-1)
    columns = [log_probs.gather(1, pick(tokens).unsqueeze(1))]
    top_n = max(counts)
    if top_n:
        values, ids = torch.topk(log_probs, k=min(top_n, log_probs.shape[-1]), dim=-1)
        columns += [values, ids.to(torch.float32)]
    return asking, counts, torch.cat(columns, dim=1)


@dataclass
class SampledTokens:
    """A step's tokens queued with the logprobs of the rows that asked (see
    :func:`token_logprobs`), read back together by :meth:`LogitsSampler.read_tokens`."""

    tokens: torch.Tensor
    positions: list[int]
    counts: list[int]
    table: torch.Tensor
    #: Filled by ``read_tokens``: per row, its logprobs or None.
    host: list[RowLogprobs | None] | None = None

    def read(self) -> list[int]:
        """The tokens, and the logprobs into :attr:`host`, in one device-to-host copy (a
        float64 vector holds every token id and float32 value exactly)."""
        num_rows = self.tokens.shape[0]
        flat = torch.cat(
            (self.tokens.to(torch.float64), self.table.to(torch.float64).flatten())
        ).tolist()
        tokens = [int(t) for t in flat[:num_rows]]
        width = self.table.shape[1]
        top_n = (width - 1) // 2
        host: list[RowLogprobs | None] = [None] * num_rows
        for j, (position, count) in enumerate(zip(self.positions, self.counts, strict=True)):
            row = flat[num_rows + j * width : num_rows + (j + 1) * width]
            values, ids = row[1 : 1 + top_n], row[1 + top_n :]
            host[position] = (row[0], [(int(ids[k]), values[k]) for k in range(count)])
        self.host = host
        return tokens


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


def select_rows(logits: torch.Tensor, row_index: list[int]) -> torch.Tensor:
    """The logits rows ``row_index`` (all of them, in order, without a copy when possible)."""
    if row_index == list(range(logits.shape[0])):
        return logits
    return logits[to_device(row_index, torch.long, logits.device)]


def _greedy_rows(logits: torch.Tensor, row_index: list[int]) -> torch.Tensor:
    """The argmax of the logits rows ``row_index``: of every row, then the chosen ids picked
    (a few ints) rather than the rows gathered first (a [R, V] copy), unless most rows are
    someone else's."""
    if 2 * len(row_index) < logits.shape[0]:
        return select_rows(logits, row_index).argmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    if row_index == list(range(logits.shape[0])):
        return tokens
    return tokens.index_select(0, to_device(row_index, torch.long, logits.device))


class LogitsSampler:
    """The decoder's window on the device: it hands over row indices and plain parameters,
    and gets back tokens and beam candidates as plain Python.

    The decoder (:mod:`server.continuous_batching.decoding`) never touches a tensor; every
    tensor op of the token choice runs here. Plain tokens come in two phases so that the
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
                return _greedy_rows(logits, row_index)
            return sample(select_rows(logits, row_index), params)
        selected = select_rows(logits, row_index)
        need_scores = any(row.logprobs_mode == "processed" for row in params)
        tokens, scores = _choose(selected, params, need_scores)
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
