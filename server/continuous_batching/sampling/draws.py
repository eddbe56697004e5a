"""The token choice: greedy rows take the argmax of their scores, sampled rows draw.

In a batch only the rows that process their logits are copied and processed; the plain greedy
rows take their argmax alone (:func:`choose`; :func:`choose_all` is the reference that
processes all), so an all-greedy batch without penalties costs a single ``argmax``.

Reproducibility: a sampled row draws its randomness from its own ``torch.Generator`` with the
"exponential race" ``argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d. per token, which picks token
``i`` with probability ``probs[i]`` (same law as ``torch.multinomial``). A row consumes exactly
``V`` exponentials from its generator per step, whatever else is batched, so a seeded request
gives the same tokens alone or in any batch. The engine's seeded rows carry a ``draw_key``
instead (:mod:`server.continuous_batching.decoding.draw_keys`): their draw seeds a generator
afresh from the seed, the choice and the position, so that a stream resumed on another server
draws the same. The draws differ from ``generate``'s multinomial, so the samples are not those
transformers would draw for the same seed.
"""

from __future__ import annotations

import torch

from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.processors import (
    index_tensor,
    process_logits,
    select_rows,
)

__all__ = ["choose", "choose_all", "greedy_rows", "make_generator", "sample"]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``, or ``None`` (global RNG) without a seed."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


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
        noise[index_tensor(unseeded, device)] = torch.empty(
            (len(unseeded), shape[1]), dtype=torch.float32, device=device
        ).exponential_()
    # A draw of exactly 0 would turn a zero probability into 0/0 = NaN, which argmax picks.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def choose(
    logits: torch.Tensor, rows: list[RowParams], need_scores: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next token ids ``[R]``, and the processed scores they were chosen from when
    ``need_scores`` (else None; None also when no row processes its logits: the scores are
    the logits then).

    Rows that process nothing (plain greedy) take the argmax of their logits; only the rows
    that do are copied, processed and, if sampled, drawn from, as a sub-batch (no [R, V]
    float32 copy of the whole batch for one penalised row). The tokens are those of
    :func:`choose_all`, which processes every row: a transform leaves the rows it does not
    apply to bit-for-bit intact, and the sampled rows draw in the same order."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} row parameters")
    processing = [i for i, row in enumerate(rows) if row.processes_logits]
    if not processing:
        return logits.argmax(dim=-1), None
    if len(processing) == len(rows):
        return choose_all(logits, rows)
    index = index_tensor(processing, logits.device)
    sub_tokens, sub_scores = choose_all(
        logits.index_select(0, index), [rows[i] for i in processing]
    )
    next_tokens = logits.argmax(dim=-1).index_copy_(0, index, sub_tokens)
    if not need_scores:
        return next_tokens, None
    scores = logits.to(dtype=torch.float32, copy=True).index_copy_(0, index, sub_scores)
    return next_tokens, scores


def choose_all(logits: torch.Tensor, rows: list[RowParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row through :func:`process_logits`, then argmax or a draw: the reference path."""
    scores = process_logits(logits, rows)
    next_tokens = scores.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.samples]
    if sampled:
        index = index_tensor(sampled, scores.device)
        probs = torch.softmax(scores[index], dim=-1)
        noise = _exponential_noise(tuple(probs.shape), [rows[i] for i in sampled], scores.device)
        next_tokens[index] = (probs / noise).argmax(dim=-1)
    return next_tokens, scores


def sample(logits: torch.Tensor, rows: list[RowParams]) -> torch.Tensor:
    """Next token ids ``[R]`` (long) for logits ``[R, V]``, each row by its own parameters."""
    return choose(logits, rows)[0]


def greedy_rows(logits: torch.Tensor, row_index: list[int]) -> torch.Tensor:
    """The argmax of the logits rows ``row_index``: of every row, then the chosen ids picked
    (a few ints) rather than the rows gathered first (a [R, V] copy), unless most rows are
    someone else's."""
    if 2 * len(row_index) < logits.shape[0]:
        return select_rows(logits, row_index).argmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    if row_index == list(range(logits.shape[0])):
        return tokens
    return tokens.index_select(0, index_tensor(row_index, logits.device))
