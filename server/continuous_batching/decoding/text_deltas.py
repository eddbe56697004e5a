"""Tokens to text: each choice's text delta of a step, stop strings, and beam results.

Every sampled sequence has its own incremental detokenizer (it holds back half characters and
what may begin a stop string). A stop string ends the sequence here, after its token was
appended by :func:`server.continuous_batching.decoding.token_acceptance.append_token`: on a
GPU the engine makes step N's text while step N+1 computes, so such a sequence may have run
one step for nothing (see :mod:`server.continuous_batching.decoding.decoder`). Beam search
makes its text once, from the finished hypotheses.

Plain Python over sequences, the tokenizer and the block manager: no tensors.
"""

from __future__ import annotations

from typing import Any

from protocol.generation import MIN_LOGPROB, TokenLogprob, TopLogprob
from server.common.backend import TextDelta
from server.common.detokenizer import IncrementalDetokenizer
from server.continuous_batching.decoding.row_params import RowLogprobs
from server.continuous_batching.scheduling.block_manager import BlockManager
from server.continuous_batching.sequence import Sequence, SequenceGroup

__all__ = ["TextDeltaMaker"]


class TextDeltaMaker:
    """Detokenises a request's tokens into :class:`TextDelta` s and applies its stop strings."""

    def __init__(self, tokenizer: Any, block_manager: BlockManager) -> None:
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        # Each token's text alone, decoded once (logprobs name tokens by their text).
        self._token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """``token_id``'s text alone (special tokens included), cached."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def token_logprob(self, token: int, logprobs: RowLogprobs) -> TokenLogprob:
        """The answer's entry for ``token`` from the sampler's values; -inf (a token that
        the processing removed) becomes ``MIN_LOGPROB``, as JSON has no infinity."""
        chosen, top = logprobs
        return TokenLogprob(
            token_id=token,
            token=self.token_text(token),
            logprob=max(chosen, MIN_LOGPROB),
            top_logprobs=[
                TopLogprob(token_id=t, token=self.token_text(t), logprob=max(v, MIN_LOGPROB))
                for t, v in top
            ],
        )

    def new_detokenizer(self, group: SequenceGroup) -> IncrementalDetokenizer:
        """A detokenizer that cuts at the request's stop strings."""
        return IncrementalDetokenizer.for_config(self.tokenizer, group.config)

    def token_delta(
        self,
        group: SequenceGroup,
        seq: Sequence,
        token: int,
        logprobs: RowLogprobs | None = None,
    ) -> TextDelta:
        """The choice's delta for ``token`` (appended already); a stop string ends it.

        A stop id adds no text (it is not part of the answer); a finished sequence flushes
        what its detokenizer held back. ``logprobs`` (the request asked) ride on the delta of
        their token, whether or not its text comes now.
        """
        if seq.detokenizer is None:
            seq.detokenizer = self.new_detokenizer(group)
        text = "" if token in group.stop_token_ids else seq.detokenizer.add_tokens([token])
        if seq.detokenizer.is_stopped and seq.finish_reason != "stop":
            # A stop string wins over the length, as it would have in one pass. Freeing is
            # safe while a later step is in flight: the device runs work in order, and the
            # host hands blocks out again only when it schedules the next step.
            seq.finish_reason = "stop"
            self.block_manager.free(seq)  # a no-op when the length freed it already
        if seq.is_finished:
            text += seq.detokenizer.flush()
        return TextDelta(
            index=seq.choice_index,
            text=text,
            num_new_tokens=1,
            finish_reason=seq.finish_reason,
            token_ids=[token],
            logprobs=None if logprobs is None else [self.token_logprob(token, logprobs)],
            prompt_logprobs=self._prompt_logprobs_once(group, seq, seq.choice_index),
        )

    def _prompt_logprobs_once(
        self, group: SequenceGroup, seq: Sequence, index: int
    ) -> list[TokenLogprob] | None:
        """The prompt's logprobs for choice ``index``'s first delta (the request scores its
        prompt), else None: every choice shows them once."""
        if not group.is_scoring_prompt or index in group.prompt_logprobs_sent:
            return None
        group.prompt_logprobs_sent.add(index)
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        return [
            self.token_logprob(prompt[p + 1], entry)
            for p, entry in enumerate(group.prompt_logprobs)
        ]

    def beam_deltas(
        self, group: SequenceGroup, hypotheses: list[tuple[list[int], float]]
    ) -> list[TextDelta]:
        """One closing delta per finished beam hypothesis ``(generated ids, score)``, best
        first: the whole text at once, ``"stop"`` if it ended on a stop id or stop string."""
        deltas = []
        stop_ids = group.stop_token_ids
        for index, (token_ids, _score) in enumerate(hypotheses):
            ends_with_stop = bool(token_ids) and token_ids[-1] in stop_ids
            detokenizer = self.new_detokenizer(group)
            body = token_ids[:-1] if ends_with_stop else token_ids
            text = detokenizer.add_tokens(body) + detokenizer.flush()
            is_stop = ends_with_stop or detokenizer.is_stopped
            deltas.append(
                TextDelta(
                    index=index,
                    text=text,
                    num_new_tokens=len(token_ids),
                    finish_reason="stop" if is_stop else "length",
                    token_ids=list(token_ids),
                    prompt_logprobs=self._prompt_logprobs_once(group, group.seqs[0], index),
                )
            )
        return deltas
