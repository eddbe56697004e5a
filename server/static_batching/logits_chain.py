"""The logits processors of a static-batching package, row by row.

OpenAI's knobs (``logit_bias``, ``presence_penalty``, ``frequency_penalty``, ``min_p``; vLLM's
``allowed_token_ids`` and ``bad_words``) are
applied with the CB engine's definitions (:mod:`server.common.logit_knobs`) in vLLM's order.
transformers runs the processors a caller passes after its own processors and before its
warpers, which would put the bias after the repetition penalty and ``min_p`` after top-p; so a
package that uses the knobs gets its whole chain from here (transformers' own processor
and warper classes for Hugging Face's knobs), in that order. A package that uses none runs
exactly as before.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from protocol.generation import GenerationConfig
from server.common.bad_words import bad_word_bans
from server.common.logit_knobs import (
    allowed_pairs,
    apply_additive_penalties,
    apply_logit_bias,
    keep_allowed,
)
from server.static_batching.rows import Row


class MinNewTokensProcessor(LogitsProcessor):
    """Keeps each row's end tokens (EOS, stop token ids) away until its ``min_new_tokens``."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for i, row in enumerate(self.rows):
            is_done = row.is_finished or row.num_generated >= row.config.min_new_tokens
            if is_done or not row.end_token_ids:
                continue
            end_ids = list(row.end_token_ids)
            saved = scores[i, end_ids].clone()
            scores[i, end_ids] = -float("inf")
            if torch.isinf(scores[i]).all():
                # Earlier filters (top-k/top-p) left only end tokens: masking would leave
                # nothing to sample, so let the row end rather than fail the package.
                scores[i, end_ids] = saved
        return scores


class LogitBiasProcessor(LogitsProcessor):
    """Each row's ``logit_bias`` (rows without one are left as they are)."""

    def __init__(self, rows: list[Row], device: torch.device) -> None:
        pairs = [
            (i, token, bias)
            for i, row in enumerate(rows)
            for token, bias in row.config.logit_bias.items()
        ]
        # Built once: the biases do not change while the package runs.
        self.row_index = torch.tensor([i for i, _, _ in pairs], dtype=torch.long, device=device)
        self.token_index = torch.tensor([t for _, t, _ in pairs], dtype=torch.long, device=device)
        self.bias = torch.tensor([b for _, _, b in pairs], dtype=torch.float32, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return apply_logit_bias(scores, self.row_index, self.token_index, self.bias)


class AllowedTokensProcessor(LogitsProcessor):
    """vLLM's ``allowed_token_ids``: every other token of such a row scores -inf."""

    def __init__(self, rows: list[Row], device: torch.device) -> None:
        limited = [i for i, row in enumerate(rows) if row.config.allowed_token_ids]
        row_ids, token_ids = allowed_pairs(
            limited, [rows[i].config.allowed_token_ids or [] for i in limited]
        )
        self.limited = torch.tensor(limited, dtype=torch.long, device=device)
        self.row_index = torch.tensor(row_ids, dtype=torch.long, device=device)
        self.token_index = torch.tensor(token_ids, dtype=torch.long, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return keep_allowed(scores, self.limited, self.row_index, self.token_index)


class BadWordsProcessor(LogitsProcessor):
    """vLLM's ``bad_words``: a word's last token scores -inf where the row's output (the
    columns past the inputs, ``input_width`` of them, and a resumed row's resumed tail) ends
    with the rest of its tokens (``server.common.bad_words``)."""

    def __init__(self, rows: list[Row], input_width: int) -> None:
        self.rows = [
            (i, row.state.request.bad_words_ids, input_width - row.num_resumed)
            for i, row in enumerate(rows)
            if row.state.request.bad_words_ids
        ]
        #: The most output tokens a word's check reads.
        self.num_read = max(len(ids) - 1 for _, words, _ in self.rows for ids in words)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        width = input_ids.shape[1]
        for i, words, output_start in self.rows:
            tail = input_ids[i, max(output_start, width - self.num_read) :].tolist()
            banned = bad_word_bans(words, tail)
            if banned:
                scores[i, banned] = -float("inf")
        return scores


class AdditivePenaltiesProcessor(LogitsProcessor):
    """Each row's frequency and presence penalties over its output tokens: the columns of
    ``input_ids`` past the (left-padded) inputs, ``input_width`` of them, and, for a resumed
    row, the last ``num_resumed`` columns of its input (the tokens generated before the
    switch, which the row's input ends with)."""

    def __init__(self, rows: list[Row], input_width: int, device: torch.device) -> None:
        penalised = [
            i
            for i, row in enumerate(rows)
            if row.config.presence_penalty != 0.0 or row.config.frequency_penalty != 0.0
        ]
        num_resumed = [rows[i].num_resumed for i in penalised]
        most_resumed = max(num_resumed, default=0)
        #: The first column read: the earliest resumed token of the penalised rows.
        self.start = input_width - most_resumed
        #: [r, most_resumed]: True where a read input column is not the row's output (the
        #: prompt, or padding), replaced by the vocabulary size (ignored) at each step.
        self.not_output = torch.tensor(
            [[j < most_resumed - n for j in range(most_resumed)] for n in num_resumed],
            dtype=torch.bool,
            device=device,
        ).reshape(len(penalised), most_resumed)
        self.rows = torch.tensor(penalised, dtype=torch.long, device=device)
        self.is_any_resumed = most_resumed > 0
        self.frequency = torch.tensor(
            [[rows[i].config.frequency_penalty] for i in penalised], device=device
        )
        self.presence = torch.tensor(
            [[rows[i].config.presence_penalty] for i in penalised], device=device
        )

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[self.rows, self.start :]  # a copy: advanced indexing
        if generated.shape[1] == 0:
            return scores  # nothing generated yet: nothing to count
        if self.is_any_resumed:
            num_read = self.not_output.shape[1]
            generated[:, :num_read].masked_fill_(self.not_output, scores.shape[1])
        scores[self.rows] = apply_additive_penalties(
            scores[self.rows], generated, self.frequency, self.presence
        )
        return scores


def uses_logit_knobs(rows: list[Row]) -> bool:
    """True when a row of the package uses one of OpenAI's knobs (min-p only if it samples)."""
    return any(
        row.config.logit_bias
        or row.config.allowed_token_ids
        or row.state.request.bad_words_ids
        or row.config.presence_penalty != 0.0
        or row.config.frequency_penalty != 0.0
        or (row.config.do_sample and row.config.min_p > 0.0)
        for row in rows
    )


def knob_processors(
    rows: list[Row],
    config: GenerationConfig,
    input_width: int,
    sampling: dict[str, Any],
    device: torch.device,
) -> list[LogitsProcessor]:
    """The package's processing chain when it uses OpenAI's knobs, in vLLM's order:
    ``allowed_token_ids``, ``bad_words``, ``logit_bias``, repetition penalty, frequency and presence
    penalties, then (sampling) temperature, min-p, top-k, top-p, typical-p. ``sampling``
    holds the package's values of Hugging Face's knobs."""
    chain: list[LogitsProcessor] = []
    if any(row.config.allowed_token_ids for row in rows):
        chain.append(AllowedTokensProcessor(rows, device))
    if any(row.state.request.bad_words_ids for row in rows):
        chain.append(BadWordsProcessor(rows, input_width))
    if any(row.config.logit_bias for row in rows):
        chain.append(LogitBiasProcessor(rows, device))
    if sampling["repetition_penalty"] != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(sampling["repetition_penalty"]))
    if any(row.config.presence_penalty or row.config.frequency_penalty for row in rows):
        chain.append(AdditivePenaltiesProcessor(rows, input_width, device))
    if not config.do_sample:
        return chain  # greedy: no warpers, as transformers and vLLM
    if sampling["temperature"] != 1.0:
        chain.append(TemperatureLogitsWarper(sampling["temperature"]))
    if config.min_p > 0.0:
        chain.append(MinPLogitsWarper(config.min_p))
    if sampling["top_k"]:
        chain.append(TopKLogitsWarper(sampling["top_k"]))
    if sampling["top_p"] < 1.0:
        chain.append(TopPLogitsWarper(sampling["top_p"]))
    if sampling["typical_p"] < 1.0:
        chain.append(TypicalLogitsWarper(sampling["typical_p"]))
    return chain
