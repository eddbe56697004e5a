"""After the forward: choose each request's next tokens (greedy, sampling or beam search, all in
one batch), fork samples and beams, apply stop rules, and turn tokens into text deltas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from server.common.backend import TextDelta
from server.common.detokenizer import IncrementalDetokenizer
from server.continuous_batching.beam_search import BeamSearchState
from server.continuous_batching.block_manager import BlockManager
from server.continuous_batching.sampler import RowParams, beam_log_probs, sample
from server.continuous_batching.sequence import Sequence, SequenceGroup


@dataclass
class RequestOutput:
    """What one step produced for one request (``error``: it failed alone, and is over)."""

    request_id: str
    deltas: list[TextDelta] = field(default_factory=list)
    is_finished: bool = False
    error: str | None = None


@dataclass
class _PreparedRows:
    """One plain group ready to sample: its logits rows, their parameters, their sequences."""

    entry: _GroupRows
    row_index: list[int]
    params: list[RowParams]
    seqs: list[Sequence]


@dataclass
class _GroupRows:
    """The logits rows of one sampling group and the sequences they belong to."""

    group: SequenceGroup
    seqs: list[Sequence]
    rows: list[int] = field(default_factory=list)


logger = logging.getLogger(__name__)


class Decoder:
    """Owns stop rules and detokenization; mutates groups and their block tables."""

    def __init__(self, tokenizer: Any, block_manager: BlockManager, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids

    def new_detokenizer(self, group: SequenceGroup) -> IncrementalDetokenizer:
        """A detokenizer that cuts at the request's stop strings."""
        return IncrementalDetokenizer(self.tokenizer, group.config.stop)

    def start(self, group: SequenceGroup) -> None:
        """Prepare a new request: its stop token ids and its first sequence's detokenizer."""
        config = group.config
        eos = [] if config.ignore_eos else self.eos_token_ids
        group.stop_token_ids = [*eos, *config.stop_token_ids]
        for seq in group.seqs:
            seq.detokenizer = self.new_detokenizer(group)

    # -- row parameters -------------------------------------------------------------------
    @staticmethod
    def _row(group: SequenceGroup, seq: Sequence) -> RowParams:
        """``seq``'s row parameters: built on its first step, then only the ban changes."""
        row = seq.row_params
        is_min_reached = seq.num_generated >= group.config.min_new_tokens
        if row is None:
            row = seq.row_params = RowParams.from_generation_config(
                group.config,
                generator=group.generator,
                banned_token_ids=None if is_min_reached else group.stop_token_ids,
                # The live token list: the penalty follows the sequence as it grows.
                penalty_token_ids=seq.token_ids,
            )
        elif row.banned_token_ids and is_min_reached:
            row.banned_token_ids = []  # min_new_tokens reached: stop ids are allowed from now on
        return row

    def decode_step(
        self, groups: list[tuple[SequenceGroup, list[Sequence]]], logits: torch.Tensor
    ) -> list[RequestOutput]:
        """Pick tokens for every sampling group; ``logits`` rows follow the groups' sequences."""
        plain: list[_GroupRows] = []
        beams: list[_GroupRows] = []
        row = 0
        for group, seqs in groups:
            entry = _GroupRows(group, seqs, list(range(row, row + len(seqs))))
            row += len(seqs)
            (beams if group.is_beam_search else plain).append(entry)
        outputs = self._decode_plain(plain, logits) if plain else []
        for entry in beams:
            try:
                outputs.append(self._decode_beams(entry, logits))
            except Exception as exc:  # this request's fault (or a bug it hit): it alone ends
                outputs.append(self._fail(entry.group, exc))
        return outputs

    def _fail(self, group: SequenceGroup, exc: Exception) -> RequestOutput:
        """End ``group`` after an exception in its own preparation or sampling: its blocks
        are freed and its open choices end as ``abort``, with the error; the batch goes on."""
        logger.exception("request %s failed in the engine step; the others go on", group.request_id)
        num_choices = group.config.num_return_sequences
        finished = {seq.choice_index for seq in group.seqs if seq.is_finished}
        for seq in group.seqs:
            self.block_manager.free(seq)
            if not seq.is_finished:
                seq.finish_reason = "abort"
        deltas = [
            TextDelta(index=i, text="", num_new_tokens=0, finish_reason="abort")
            for i in range(num_choices)
            if group.is_beam_search or i not in finished
        ]
        return RequestOutput(
            group.request_id, deltas, is_finished=True, error=f"{type(exc).__name__}: {exc}"
        )

    # -- greedy and sampling --------------------------------------------------------------
    def _decode_plain(self, entries: list[_GroupRows], logits: torch.Tensor) -> list[RequestOutput]:
        """One token for every plain row, sampled in one batch. A request whose preparation,
        sampling or stop rules raise fails alone (see :meth:`_fail`)."""
        outputs: list[RequestOutput] = []
        prepared: list[_PreparedRows] = []
        for entry in entries:
            try:
                prepared.append(self._prepare(entry))
            except Exception as exc:
                outputs.append(self._fail(entry.group, exc))
        for rows, tokens in self._sample_each(prepared, logits, outputs):
            output = RequestOutput(rows.entry.group.request_id)
            try:
                for seq, token in zip(rows.seqs, tokens, strict=True):
                    output.deltas.append(self._append(rows.entry.group, seq, token))
            except Exception as exc:
                outputs.append(self._fail(rows.entry.group, exc))
                continue
            output.is_finished = all(s.is_finished for s in rows.entry.group.seqs)
            outputs.append(output)
        return outputs

    def _prepare(self, entry: _GroupRows) -> _PreparedRows:
        group = entry.group
        num_choices = group.config.num_return_sequences
        if len(entry.seqs) == 1 and entry.seqs[0].num_generated == 0 and num_choices > 1:
            # First token of n samples: the prompt's logits row serves every choice.
            parent = entry.seqs[0]
            params = [self._row(group, parent)] * num_choices
            children = self._fork(group, parent, num_choices)
            return _PreparedRows(entry, entry.rows * num_choices, params, children)
        params = [self._row(group, seq) for seq in entry.seqs]
        return _PreparedRows(entry, list(entry.rows), params, list(entry.seqs))

    def _sample_each(
        self, prepared: list[_PreparedRows], logits: torch.Tensor, failed: list[RequestOutput]
    ) -> list[tuple[_PreparedRows, list[int]]]:
        """The tokens of each prepared group: one batched ``sample`` for all of them; if that
        raises, each group alone, so that only the group at fault fails (into ``failed``)."""
        if not prepared:
            return []
        row_index = [r for rows in prepared for r in rows.row_index]
        params = [p for rows in prepared for p in rows.params]
        try:
            tokens = sample(_select(logits, row_index), params).tolist()
        except Exception:
            results = []
            for rows in prepared:
                try:
                    mine = sample(_select(logits, rows.row_index), rows.params).tolist()
                except Exception as exc:
                    failed.append(self._fail(rows.entry.group, exc))
                    continue
                results.append((rows, mine))
            return results
        results, start = [], 0
        for rows in prepared:
            results.append((rows, tokens[start : start + len(rows.row_index)]))
            start += len(rows.row_index)
        return results

    def _fork(self, group: SequenceGroup, parent: Sequence, num: int) -> list[Sequence]:
        children = []
        for index in range(num):
            child = parent.fork()
            self.block_manager.fork(parent, child)
            child.choice_index = index
            child.detokenizer = self.new_detokenizer(group)
            children.append(child)
        self.block_manager.free(parent)
        group.seqs = children
        return children

    def _append(self, group: SequenceGroup, seq: Sequence, token: int) -> TextDelta:
        """Add ``token`` to ``seq``, apply the stop rules, return the choice's delta."""
        config = group.config
        seq.token_ids.append(token)
        if seq.detokenizer is None:
            seq.detokenizer = self.new_detokenizer(group)
        is_stop_token = token in group.stop_token_ids
        text = "" if is_stop_token else seq.detokenizer.add_tokens([token])
        if is_stop_token or seq.detokenizer.is_stopped:
            seq.finish_reason = "stop"
        elif seq.num_generated >= (config.max_new_tokens or 0):
            seq.finish_reason = "length"
        if seq.is_finished:
            text += seq.detokenizer.flush()
            self.block_manager.free(seq)
        return TextDelta(
            index=seq.choice_index,
            text=text,
            num_new_tokens=1,
            finish_reason=seq.finish_reason,
            token_ids=[token],
        )

    # -- beam search ----------------------------------------------------------------------
    def _decode_beams(self, entry: _GroupRows, logits: torch.Tensor) -> RequestOutput:
        group = entry.group
        config = group.config
        if group.beam_state is None:
            group.beam_state = BeamSearchState(
                num_beams=config.num_beams,
                num_return_sequences=config.num_return_sequences,
                length_penalty=config.length_penalty,
                early_stopping=config.early_stopping,
                eos_token_ids=group.stop_token_ids,
                num_prompt_tokens=entry.seqs[0].num_prompt_tokens,
                max_new_tokens=config.max_new_tokens or 1,
                min_new_tokens=config.min_new_tokens,
            )
        rows = torch.tensor(entry.rows, device=logits.device)
        params = [self._row(group, seq) for seq in entry.seqs]
        log_probs = beam_log_probs(logits[rows], params)
        new_beams = group.beam_state.step(log_probs)
        children = []
        for parent_row, token in new_beams:
            parent = entry.seqs[parent_row]
            child = parent.fork()
            self.block_manager.fork(parent, child)
            child.token_ids.append(token)
            children.append(child)
        for seq in entry.seqs:
            self.block_manager.free(seq)
        group.seqs = children
        output = RequestOutput(group.request_id)
        if group.beam_state.is_done:
            for seq in children:
                self.block_manager.free(seq)
                seq.finish_reason = "length"
            output.deltas = self._beam_results(group)
            output.is_finished = True
        return output

    def _beam_results(self, group: SequenceGroup) -> list[TextDelta]:
        deltas = []
        stop_ids = group.stop_token_ids
        for index, (token_ids, _score) in enumerate(group.beam_state.finished()):
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
                )
            )
        return deltas


def _select(logits: torch.Tensor, row_index: list[int]) -> torch.Tensor:
    """The logits rows ``row_index`` (all of them, in order, without a copy when possible)."""
    if row_index == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(row_index, device=logits.device)]
