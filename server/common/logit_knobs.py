"""OpenAI's and vLLM's sampling knobs as batched torch ops, shared by both model servers.

The CB engine's sampler and the SB server's logits processors apply them with the same
functions, so both servers give one meaning to each knob. Each function takes ``[r, V]``
float32 scores of the rows that use the knob and per-row parameter tensors, on any device.

The definitions are OpenAI's and vLLM's (``vllm/v1/sample/sampler.py``, ``Sampler``'s
docstring, and ``apply_penalties`` in ``vllm/model_executor/layers/utils.py``), and so is the
order in which the servers apply them to a row's float32 logits:

1. ``logit_bias``: ``logits[t] += bias[t]`` (:func:`apply_logit_bias`);
2. the penalties: the repetition penalty (Hugging Face's, over prompt and output, unchanged),
   then ``logits[t] -= frequency_penalty * count[t]`` and ``logits[t] -= presence_penalty *
   (count[t] > 0)``, where ``count[t]`` counts ``t`` among the generated tokens only, never
   the prompt's (:func:`apply_additive_penalties`);
3. the ``min_new_tokens`` ban; a greedy row takes its argmax here;
4. sampled rows: the temperature, then ``min_p`` (:func:`apply_min_p`: tokens whose probability
   after the temperature is below ``min_p`` times the likeliest token's are dropped), then
   top-k, top-p and typical-p.

Steps 1-2 change the argmax, so they apply to greedy rows too; ``min_p`` does not.
"""

from __future__ import annotations

import torch

FILTER_VALUE = -float("inf")

__all__ = [
    "allowed_pairs",
    "apply_additive_penalties",
    "apply_logit_bias",
    "apply_min_p",
    "keep_allowed",
]


def allowed_pairs(limited: list[int], allowed: list[list[int]]) -> tuple[list[int], list[int]]:
    """vLLM's ``allowed_token_ids`` of rows ``limited`` as (row, token) pairs for
    :func:`keep_allowed`. Each row's ids are padded to the longest list with the row's own
    first id: a pair written back twice writes the same value."""
    width = max(len(ids) for ids in allowed)
    padded = [ids + ids[:1] * (width - len(ids)) for ids in allowed]
    return [i for i in limited for _ in range(width)], [t for ids in padded for t in ids]


def keep_allowed(
    scores: torch.Tensor,
    limited_index: torch.Tensor,
    row_index: torch.Tensor,
    token_index: torch.Tensor,
) -> torch.Tensor:
    """vLLM's ``allowed_token_ids``: rows ``limited_index`` keep only the scores at their
    (row, token) pairs (:func:`allowed_pairs`); every other token scores -inf (in place;
    returns ``scores``). The allowed scores are read out, the rows filled, and the scores
    written back: one pass over each limited row rather than a whole-vocabulary mask."""
    kept = scores[row_index, token_index]
    scores.index_fill_(0, limited_index, FILTER_VALUE)
    scores[row_index, token_index] = kept
    return scores


def apply_logit_bias(
    scores: torch.Tensor,
    row_index: torch.Tensor,
    token_index: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Add ``bias[i]`` to ``scores[row_index[i], token_index[i]]`` (in place; returns
    ``scores``). The (row, token) pairs are distinct: one bias per token of a row.

    Args:
        scores: ``[R, V]`` float32 scores (every row of the batch, not only the biased ones).
        row_index, token_index: ``[n]`` long.
        bias: ``[n]`` float32.
    """
    return scores.index_put_((row_index, token_index), bias, accumulate=True)


def apply_additive_penalties(
    scores: torch.Tensor,
    token_ids: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's frequency and presence penalties, as vLLM computes them: ``scores[t] -
    frequency * count(t) - presence * (count(t) > 0)``, the two subtractions in that order,
    ``count(t)`` counting ``t`` among a row's generated tokens (in place; returns ``scores``).

    Only the (row, token) pairs that occur are touched: their counts come from
    ``torch.unique`` over the ``r * L`` ids, not from a dense ``[r, V]`` count as vLLM's
    ``scatter_add`` makes it. On a CPU the dense count (zeroing, filling and reading some
    6 MB per 32 rows of a 49k vocabulary, in memory mapped afresh at every step) took a
    32-row step's sampling from 0.8 to 13 ms (median; 1.9 ms this way, see
    ``benchmarks/bench_logit_knobs.py``). Untouched tokens would only lose ``0`` there: the
    result is the same.

    Args:
        scores: ``[r, V]`` scores.
        token_ids: ``[r, L]`` long, each row's generated ids right-padded with ``V`` (a
            value past the vocabulary, ignored).
        frequency_penalty, presence_penalty: ``[r, 1]`` float32 (-2..2; negative values
            favour repetition).
    """
    num_rows, vocab_size = scores.shape
    width = vocab_size + 1  # one key per (row, token), the padding value included
    rows = torch.arange(num_rows, device=token_ids.device).unsqueeze(1)
    keys, counts = torch.unique((rows * width + token_ids).flatten(), return_counts=True)
    row, token = keys // width, keys % width
    kept = token < vocab_size
    row, token, counts = row[kept], token[kept], counts[kept].to(scores.dtype)
    values = scores[row, token] - frequency_penalty[row, 0] * counts
    scores[row, token] = values - presence_penalty[row, 0]
    return scores


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p filtering: drop the tokens whose probability is below ``min_p`` times the row's
    highest probability (the likeliest token always survives).

    Args:
        scores: ``[r, V]`` scores, after the temperature.
        min_p: ``[r, 1]`` float32 in ``[0, 1]``.
    """
    probs = torch.softmax(scores, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(probs < threshold, FILTER_VALUE)
