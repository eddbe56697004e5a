"""Logprobs of the chosen tokens, for the rows that ask (``RowParams.logprobs``) and only those.

``log_softmax`` in float32 of the raw logits, or of the processed scores the token was chosen
from (``logprobs_mode`` ``"processed"``), gathered at the chosen token, with the top-N; they
come back with the tokens in the step's one device-to-host copy (:class:`SampledTokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.continuous_batching.decoding.row_params import RowLogprobs, RowParams
from server.continuous_batching.sampling.processors import index_tensor
from server.continuous_batching.step_upload import to_device

__all__ = ["SampledTokens", "token_logprobs"]


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
    index = None if len(asking) == logits.shape[0] else index_tensor(asking, device)

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
    :func:`token_logprobs`), read back together by :meth:`read`."""

    tokens: torch.Tensor
    positions: list[int]
    counts: list[int]
    table: torch.Tensor
    #: Filled by ``read``: per row, its logprobs or None.
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
