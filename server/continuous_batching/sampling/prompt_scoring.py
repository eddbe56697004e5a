"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

A request with ``prompt_logprobs`` (``echo`` with ``logprobs`` on /v1/completions) needs the
logits of every prompt position, not only the last one's: position p's logits score prompt
token p + 1. The model runner hands the hidden states of those positions here, per prefill
chunk; the logits are computed a slice of rows at a time (a 2,048-token prompt's full logits
would be 400 MB in float32 for a 49k vocabulary), in float32, from the raw logits (no
penalty, bias or temperature: the prompt was not sampled).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from server.continuous_batching.decoding.row_params import RowLogprobs
from server.continuous_batching.sequence import SequenceGroup

#: Prompt rows whose logits are materialised at once.
ROWS_PER_SLICE = 256


@dataclass
class PromptRows:
    """One request's prompt positions in a step: flat rows of the step's hidden states, the
    token each position predicts, and how many alternatives to list."""

    group: SequenceGroup
    first_position: int
    rows: list[int]
    targets: list[int]
    num_top: int


@dataclass
class PromptScores:
    """The scores of one request's prompt positions ``first_position...`` in a step."""

    group: SequenceGroup
    first_position: int
    entries: list[RowLogprobs]


def prompt_rows_of(
    group: SequenceGroup,
    token_ids: list[int],
    num_prompt_tokens: int,
    chunk: tuple[int, int],
    first_row: int,
) -> PromptRows | None:
    """The positions of the chunk ``[start, end)`` (its first token at flat row ``first_row``
    of the step) that score a prompt token: each position before the prompt's last scores
    the next token. None when the request does not score its prompt or the chunk has none."""
    start, end = chunk
    stop = min(end, num_prompt_tokens - 1)
    if not group.is_scoring_prompt or start >= stop:
        return None
    rows = list(range(first_row, first_row + stop - start))
    num_top = group.config.prompt_logprobs or 0
    return PromptRows(group, start, rows, token_ids[start + 1 : stop + 1], num_top)


def score_prompt_rows(
    hidden: torch.Tensor,
    requests: list[PromptRows],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[PromptScores]:
    """Each request's prompt logprobs from ``hidden`` (its ``rows`` are flat row indices into
    it): the target token's logprob and the ``num_top`` likeliest, best first."""
    if not requests:
        return []
    rows = [r for request in requests for r in request.rows]
    targets = [t for request in requests for t in request.targets]
    num_top = max(request.num_top for request in requests)
    chosen_parts: list[torch.Tensor] = []
    top_values: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    device = hidden.device
    for start in range(0, len(rows), ROWS_PER_SLICE):
        index = torch.tensor(rows[start : start + ROWS_PER_SLICE], device=device)
        wanted = torch.tensor(targets[start : start + ROWS_PER_SLICE], device=device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]).float(), dim=-1)
        chosen_parts.append(logprobs.gather(1, wanted[:, None])[:, 0])
        if num_top:
            values, ids = logprobs.topk(num_top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    chosen = torch.cat(chosen_parts).tolist()
    values_list = torch.cat(top_values).tolist() if num_top else []
    ids_list = torch.cat(top_ids).tolist() if num_top else []
    scores: list[PromptScores] = []
    offset = 0
    for request in requests:
        entries: list[RowLogprobs] = []
        n = request.num_top
        for i in range(offset, offset + len(request.rows)):
            top = list(zip(ids_list[i][:n], values_list[i][:n], strict=True)) if n else []
            entries.append((chosen[i], top))
        offset += len(request.rows)
        scores.append(PromptScores(request.group, request.first_position, entries))
    return scores
