"""Batched logits processors with per-row parameters, matching transformers' processors.

Each function takes a ``[r, V]`` float32 score tensor holding only the rows that use the
transform, plus per-row parameter tensors, and returns new scores. The arithmetic follows
``transformers.generation.logits_process`` line by line (same ops, same dtypes, same
comparisons), so a row processed here in a batch gives the same scores as Hugging Face's
processor applied to that row alone:

- ``RepetitionPenaltyLogitsProcessor`` -> :func:`apply_repetition_penalty`
- ``MinNewTokensLengthLogitsProcessor`` (and any "ban these ids") -> :func:`apply_banned_tokens`
- ``TemperatureLogitsWarper`` -> :func:`apply_temperature`
- ``TopKLogitsWarper`` -> :func:`apply_top_k`
- ``TopPLogitsWarper`` -> :func:`apply_top_p`
- ``TypicalLogitsWarper`` -> :func:`apply_typical_p`

The warpers use ``min_tokens_to_keep=1``, which is what ``generate`` passes when it samples
without beams.
"""

from __future__ import annotations

import torch

FILTER_VALUE = -float("inf")


def apply_repetition_penalty(
    scores: torch.Tensor, token_ids: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """Penalise every token that occurs in a row's ``token_ids`` once (HF's CTRL penalty).

    Args:
        scores: ``[r, V]`` scores.
        token_ids: ``[r, L]`` ids per row, right-padded with ``V`` (an extra dropped column,
            the same trick HF uses for ids beyond the output vocabulary).
        penalty: ``[r, 1]`` float32 penalties.
    """
    vocab_size = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, 1))
    score = torch.gather(padded, 1, token_ids)
    # Negative scores are multiplied, positive ones divided, so p > 1 always lowers them.
    score = torch.where(score < 0, score * penalty, score / penalty)
    return padded.scatter(1, token_ids, score)[..., :vocab_size]


def apply_banned_tokens(
    scores: torch.Tensor, row_index: torch.Tensor, token_index: torch.Tensor
) -> torch.Tensor:
    """Set ``scores[row_index[i], token_index[i]]`` to ``-inf`` (in place; returns ``scores``)."""
    scores[row_index, token_index] = FILTER_VALUE
    return scores


def apply_temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (``[r, 1]`` float32)."""
    return scores / temperature


def apply_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` best scores (ties at the threshold are all kept, as in HF).

    Args:
        scores: ``[r, V]`` scores.
        top_k: ``[r]`` long, already clamped to ``[min_tokens_to_keep, V]``.
    """
    # One topk with the largest k serves every row: the k-th largest value of a row does not
    # depend on how many values were asked for.
    k_max = int(top_k.max())
    top_values = torch.topk(scores, k_max, dim=-1)[0]
    threshold = top_values.gather(1, (top_k - 1).unsqueeze(1))
    return scores.masked_fill(scores < threshold, FILTER_VALUE)


def apply_top_p(scores: torch.Tensor, one_minus_top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering: drop the least likely tokens whose total mass is ``<= 1 - top_p``.

    Args:
        scores: ``[r, V]`` scores.
        one_minus_top_p: ``[r, 1]`` float32 holding ``1 - top_p`` computed in double precision,
            because HF compares against that Python float.
    """
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_indices_to_remove = cumulative_probs <= one_minus_top_p
    # min_tokens_to_keep = 1: the most likely token always survives.
    sorted_indices_to_remove[..., -1:] = False
    indices_to_remove = sorted_indices_to_remove.scatter(
        1, sorted_indices, sorted_indices_to_remove
    )
    return scores.masked_fill(indices_to_remove, FILTER_VALUE)


def apply_typical_p(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical filtering: keep tokens whose surprisal is closest to the entropy.

    Args:
        scores: ``[r, V]`` scores.
        mass: ``[r, 1]`` float32 ``typical_p`` per row.
    """
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    ent = -(normalized * p).nansum(-1, keepdim=True)

    shifted_scores = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted_scores, descending=False)
    sorted_logits = scores.gather(-1, sorted_indices)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)

    last_ind = (cumulative_probs < mass).sum(dim=1)
    last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
    sorted_indices_to_remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
    # min_tokens_to_keep = 1: the most typical token always survives.
    sorted_indices_to_remove[..., :1] = False
    indices_to_remove = sorted_indices_to_remove.scatter(
        1, sorted_indices, sorted_indices_to_remove
    )
    return scores.masked_fill(indices_to_remove, FILTER_VALUE)
