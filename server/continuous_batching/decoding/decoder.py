"""After the forward: choose each request's next tokens (greedy, sampling or beam search, all in
one batch), fork samples and beams, apply stop rules, and turn tokens into text deltas.

Three phases, so that the engine can overlap the host's work with the device's:
:meth:`Decoder.launch` queues the sampling on the device, :meth:`Decoder.collect` reads the
tokens back (the step's one device-to-host sync) and applies the stop rules that need only the
token (stop ids, ``max_new_tokens``), and :meth:`Decoder.finish_text` detokenises and applies
stop strings. On a GPU the engine runs ``finish_text`` for step N while step N+1's forward
computes; a sequence that a stop string ends then has run in step N+1 for nothing, and
``launch`` gives it no token.

The decoder is the bookkeeping, in plain Python: it never touches a tensor (nor imports torch).
Every tensor op of the token choice runs behind a :class:`TokenSampler`
(:class:`server.continuous_batching.sampling.sampler.LogitsSampler` in the engine), which takes row
indices and row parameters and gives back plain tokens and beam candidates. The rules live by
concern: :mod:`~server.continuous_batching.decoding.token_acceptance` (row parameters, stop ids,
lengths), :mod:`~server.continuous_batching.decoding.sequence_forks` (samples and beams sharing
blocks), :mod:`~server.continuous_batching.decoding.text_deltas` (text and stop strings),
:mod:`~server.continuous_batching.decoding.beam_search` (the beams' scores and choices), and
:mod:`~server.continuous_batching.decoding.steps` (what the phases hand over).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from server.common.backend import TextDelta
from server.continuous_batching.decoding.beam_search import BeamSearchState
from server.continuous_batching.decoding.draw_keys import draw_key
from server.continuous_batching.decoding.sequence_forks import finish_all, fork_beams, fork_samples
from server.continuous_batching.decoding.steps import (
    GroupRows,
    GroupTokens,
    Logits,
    PreparedRows,
    RequestOutput,
    SampledStep,
    StepTokens,
    TokenSampler,
)
from server.continuous_batching.decoding.text_deltas import TextDeltaMaker
from server.continuous_batching.decoding.token_acceptance import (
    append_token,
    row_params_for,
    stop_token_ids_for,
)
from server.continuous_batching.scheduling.block_manager import BlockManager
from server.continuous_batching.sequence import Sequence, SequenceGroup


def _draw_key_of(group: SequenceGroup, seq: Sequence) -> int:
    """The key of ``seq``'s next seeded draw: the request's seed, the choice's index in the
    answer, the token's position in the output (see ``draw_keys``)."""
    assert group.config.seed is not None
    return draw_key(group.config.seed, group.choice_offset + seq.choice_index, seq.num_generated)


__all__ = ["Decoder", "RequestOutput", "StepTokens", "TokenSampler"]

logger = logging.getLogger(__name__)


class Decoder:
    """Owns stop rules and detokenization; mutates groups and their block tables."""

    def __init__(
        self,
        tokenizer: Any,
        block_manager: BlockManager,
        eos_token_ids: list[int],
        sampler: TokenSampler,
    ) -> None:
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.sampler = sampler
        self.text = TextDeltaMaker(tokenizer, block_manager)

    def start(self, group: SequenceGroup) -> None:
        """Prepare a new request: its stop token ids and its first sequence's detokenizer."""
        group.stop_token_ids = stop_token_ids_for(group.config, self.eos_token_ids)
        for seq in group.seqs:
            seq.detokenizer = self.text.new_detokenizer(group)

    def resume(self, seq: Sequence, token_ids: list[int], num_text_chars: int) -> None:
        """Prime ``seq``'s detokenizer with the tokens another server generated for it, of
        whose text the caller has ``num_text_chars`` characters: what was held back (half a
        character, the start of a possible stop string) comes with the next text."""
        seq.detokenizer.resume(token_ids, num_text_chars)

    def launch(
        self, groups: list[tuple[SequenceGroup, list[Sequence]]], logits: Logits
    ) -> SampledStep:
        """Queue the choice of every plain row (one batch) and run the beam-search groups. A
        sequence that a stop string ended after the step was planned (see the module docstring)
        gets no token: its logits row is skipped."""
        plain: list[GroupRows] = []
        beams: list[GroupRows] = []
        row = 0
        for group, seqs in groups:
            entry = GroupRows(group, seqs, list(range(row, row + len(seqs))))
            row += len(seqs)
            (beams if group.is_beam_search else plain).append(entry)
        outputs: list[RequestOutput] = []
        prepared: list[PreparedRows] = []
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
            token_lists = self.sampler.read_tokens(tokens)
            asks = any(p.logprobs is not None for rows in batch for p in rows.params)
            logprob_lists = self.sampler.read_logprobs(tokens) if asks else []
            start = 0
            for rows in batch:
                end = start + len(rows.row_index)
                mine = token_lists[start:end]
                my_logprobs = logprob_lists[start:end]
                start = end
                group = rows.entry.group
                pairs: list[tuple[Sequence, int]] = []
                try:
                    for seq, token in zip(rows.seqs, mine, strict=True):
                        append_token(group, seq, token, self.block_manager)
                        pairs.append((seq, token))
                except Exception as exc:
                    result.outputs.append(self._fail(group, exc))
                    continue
                if pairs:
                    result.groups.append(GroupTokens(group, pairs, my_logprobs[: len(pairs)]))
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
                for j, (seq, token) in enumerate(entry.tokens):
                    logprobs = entry.logprobs[j] if entry.logprobs else None
                    output.deltas.append(self.text.token_delta(group, seq, token, logprobs))
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
    def _prepare(self, entry: GroupRows) -> PreparedRows | None:
        """The rows ``entry`` samples this step: every live sequence's, or, for the first
        token of ``n`` samples, the prompt's row once per sample (forked here)."""
        group = entry.group
        num_choices = group.config.num_return_sequences
        if len(entry.seqs) == 1 and entry.seqs[0].num_generated == 0 and num_choices > 1:
            # First token of n samples: the prompt's logits row serves every choice.
            parent = entry.seqs[0]
            base = row_params_for(group, parent)
            children = fork_samples(
                group, parent, num_choices, self.block_manager, self.text.new_detokenizer
            )
            params = [base] * num_choices
            if group.config.seed is not None:  # each choice draws with its own key
                params = [replace(base, draw_key=_draw_key_of(group, child)) for child in children]
            return PreparedRows(entry, entry.rows * num_choices, params, children)
        live = [
            (row, seq)
            for row, seq in zip(entry.rows, entry.seqs, strict=True)
            if not seq.is_finished
        ]
        if not live:
            return None
        params = [row_params_for(group, seq) for _, seq in live]
        if group.config.seed is not None:
            for row_params, (_, seq) in zip(params, live, strict=True):
                row_params.draw_key = _draw_key_of(group, seq)
        return PreparedRows(entry, [row for row, _ in live], params, [seq for _, seq in live])

    def _sample_each(
        self, prepared: list[PreparedRows], logits: Logits, failed: list[RequestOutput]
    ) -> list[tuple[list[PreparedRows], Any]]:
        """The tokens of the prepared groups: one batched ``sample`` for all of them; if that
        raises, each group alone, so that only the group at fault fails (into ``failed``)."""
        if not prepared:
            return []
        row_index = [r for rows in prepared for r in rows.row_index]
        params = [p for rows in prepared for p in rows.params]
        try:
            return [(prepared, self.sampler.sample(logits, row_index, params))]
        except Exception:
            results = []
            for rows in prepared:
                try:
                    mine = self.sampler.sample(logits, rows.row_index, rows.params)
                except Exception as exc:
                    failed.append(self._fail(rows.entry.group, exc))
                    continue
                results.append(([rows], mine))
            return results

    # -- beam search ----------------------------------------------------------------------
    def _decode_beams(self, entry: GroupRows, logits: Logits) -> RequestOutput:
        """One beam-search step of ``entry``'s request: the candidates from the sampler, the
        new beams from its state, forked from their parents; the results once it is done."""
        group = entry.group
        state = group.beam_state
        if state is None:
            config = group.config
            state = group.beam_state = BeamSearchState(
                num_beams=config.num_beams,
                num_return_sequences=config.num_return_sequences,
                length_penalty=config.length_penalty,
                early_stopping=config.early_stopping,
                eos_token_ids=group.stop_token_ids,
                num_prompt_tokens=entry.seqs[0].num_prompt_tokens,
                max_new_tokens=config.max_new_tokens or 1,
                min_new_tokens=config.min_new_tokens,
            )
        params = [row_params_for(group, seq) for seq in entry.seqs]
        candidates = self.sampler.beam_candidates(
            logits, entry.rows, params, state.running_scores, state.num_candidates
        )
        children = fork_beams(group, entry.seqs, state.step(candidates), self.block_manager)
        output = RequestOutput(group.request_id)
        if state.is_done:
            finish_all(children, "length", self.block_manager)
            output.deltas = self.text.beam_deltas(group, state.finished())
            output.is_finished = True
        return output
