"""After the forward: choose each request's next tokens (greedy, sampling or beam search, all in
one batch), fork samples and beams, apply stop rules, and turn tokens into text deltas.

Three phases, so that the engine can overlap the host's work with the device's:
:meth:`Decoder.launch` queues the sampling on the device, :meth:`Decoder.collect` reads the
tokens back (the step's one device-to-host sync) and applies the stop rules that need only the
token (stop ids, ``max_new_tokens``), and :meth:`Decoder.finish_text` detokenises and applies
stop strings. On a GPU the engine runs ``finish_text`` for step N while step N+1's forward
computes; a sequence that a stop string ends then has run in step N+1 for nothing, and
``launch`` gives it no token.
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
from server.continuous_batching.step_upload import to_device


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


@dataclass
class SampledStep:
    """A step's token choice queued on the device, not read back yet (:meth:`Decoder.launch`)."""

    #: Plain groups and their tokens: one tensor for all, or one per group after a failure.
    batches: list[tuple[list[_PreparedRows], torch.Tensor]]
    #: Ready now: beam-search steps (they sync on their own) and failed requests.
    outputs: list[RequestOutput]


@dataclass
class _GroupTokens:
    """One group's new tokens of a step, appended to their sequences, text still to make."""

    group: SequenceGroup
    tokens: list[tuple[Sequence, int]]


@dataclass
class StepTokens:
    """A step's tokens read back and appended (:meth:`Decoder.collect`)."""

    groups: list[_GroupTokens] = field(default_factory=list)
    #: Beam-search steps and failed requests: outputs without text to make.
    outputs: list[RequestOutput] = field(default_factory=list)
    #: Groups whose every sequence ended on a stop id or its length: nothing more to schedule.
    finished: list[SequenceGroup] = field(default_factory=list)

    def drop(self, group: SequenceGroup) -> None:
        """Forget ``group``'s pending text (it was aborted)."""
        self.groups = [entry for entry in self.groups if entry.group is not group]


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

    def launch(
        self, groups: list[tuple[SequenceGroup, list[Sequence]]], logits: torch.Tensor
    ) -> SampledStep:
        """Queue the choice of every plain row (one batch) and run the beam-search groups. A
        sequence that a stop string ended after the step was planned (see the module docstring)
        gets no token: its logits row is skipped."""
        plain: list[_GroupRows] = []
        beams: list[_GroupRows] = []
        row = 0
        for group, seqs in groups:
            entry = _GroupRows(group, seqs, list(range(row, row + len(seqs))))
            row += len(seqs)
            (beams if group.is_beam_search else plain).append(entry)
        outputs: list[RequestOutput] = []
        prepared: list[_PreparedRows] = []
        for entry in plain:
            try:
                rows = self._prepare(entry)
            except Exception as exc:
                outputs.append(self._fail(entry.group, exc))
                continue
            if rows is not None:
                prepared.append(rows)
        batches = self._sample_each(prepared, logits, outputs)
        for entry in beams:
            try:
                outputs.append(self._decode_beams(entry, logits))
            except Exception as exc:  # this request's fault (or a bug it hit): it alone ends
                outputs.append(self._fail(entry.group, exc))
        return SampledStep(batches, outputs)

    def collect(self, step: SampledStep) -> StepTokens:
        """Read the tokens back and append them; stop ids and lengths end sequences here."""
        result = StepTokens(outputs=step.outputs)
        for batch, tokens in step.batches:
            token_lists = tokens.tolist()
            start = 0
            for rows in batch:
                mine = token_lists[start : start + len(rows.row_index)]
                start += len(rows.row_index)
                group = rows.entry.group
                pairs: list[tuple[Sequence, int]] = []
                try:
                    for seq, token in zip(rows.seqs, mine, strict=True):
                        self._append_token(group, seq, token)
                        pairs.append((seq, token))
                except Exception as exc:
                    result.outputs.append(self._fail(group, exc))
                    continue
                if pairs:
                    result.groups.append(_GroupTokens(group, pairs))
                if all(seq.is_finished for seq in group.seqs):
                    result.finished.append(group)
        return result

    def finish_text(self, step: StepTokens) -> list[RequestOutput]:
        """Detokenise ``step``'s tokens and apply stop strings: one output per group."""
        outputs: list[RequestOutput] = []
        for entry in step.groups:
            group = entry.group
            output = RequestOutput(group.request_id)
            try:
                for seq, token in entry.tokens:
                    output.deltas.append(self._text(group, seq, token))
            except Exception as exc:
                outputs.append(self._fail(group, exc))
                continue
            output.is_finished = all(s.is_finished for s in group.seqs)
            outputs.append(output)
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
    def _prepare(self, entry: _GroupRows) -> _PreparedRows | None:
        group = entry.group
        num_choices = group.config.num_return_sequences
        if len(entry.seqs) == 1 and entry.seqs[0].num_generated == 0 and num_choices > 1:
            # First token of n samples: the prompt's logits row serves every choice.
            parent = entry.seqs[0]
            params = [self._row(group, parent)] * num_choices
            children = self._fork(group, parent, num_choices)
            return _PreparedRows(entry, entry.rows * num_choices, params, children)
        live = [
            (row, seq)
            for row, seq in zip(entry.rows, entry.seqs, strict=True)
            if not seq.is_finished
        ]
        if not live:
            return None
        params = [self._row(group, seq) for _, seq in live]
        return _PreparedRows(entry, [row for row, _ in live], params, [seq for _, seq in live])

    def _sample_each(
        self, prepared: list[_PreparedRows], logits: torch.Tensor, failed: list[RequestOutput]
    ) -> list[tuple[list[_PreparedRows], torch.Tensor]]:
        """The tokens of the prepared groups: one batched ``sample`` for all of them; if that
        raises, each group alone, so that only the group at fault fails (into ``failed``)."""
        if not prepared:
            return []
        row_index = [r for rows in prepared for r in rows.row_index]
        params = [p for rows in prepared for p in rows.params]
        try:
            return [(prepared, sample(_select(logits, row_index), params))]
        except Exception:
            results = []
            for rows in prepared:
                try:
                    mine = sample(_select(logits, rows.row_index), rows.params)
                except Exception as exc:
                    failed.append(self._fail(rows.entry.group, exc))
                    continue
                results.append(([rows], mine))
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

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        """Add ``token`` to ``seq`` and apply the stop rules that need no text (stop ids,
        ``max_new_tokens``); a sequence that ends gives its blocks back now."""
        seq.token_ids.append(token)
        if token in group.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.num_generated >= (group.config.max_new_tokens or 0):
            seq.finish_reason = "length"
        if seq.is_finished:
            self.block_manager.free(seq)

    def _text(self, group: SequenceGroup, seq: Sequence, token: int) -> TextDelta:
        """The choice's delta for ``token`` (appended already); a stop string ends it."""
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
    return logits[to_device(row_index, torch.long, logits.device)]
