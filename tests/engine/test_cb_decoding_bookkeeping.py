"""The decoder's bookkeeping without a model or torch: stop rules, forks, text, failures.

Sequences, groups and the block manager are the real (plain Python) ones, on a tiny pool; the
tokenizer maps each id to a fixed piece of text; the sampler is a plain-Python stand-in for
``LogitsSampler`` whose "logits" are lists of floats (argmax, banned ids honoured). That the
decoding room imports no torch is checked by ``test_torch_free_rooms.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from protocol.generation import GenerationConfig
from server.continuous_batching.decoding.beam_search import BeamCandidate, float32
from server.continuous_batching.decoding.cpu_topk_order import topk_indices
from server.continuous_batching.decoding.decoder import Decoder, RequestOutput
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.decoding.sequence_forks import fork_beams, fork_samples
from server.continuous_batching.decoding.token_acceptance import (
    append_token,
    row_params_for,
    stop_token_ids_for,
)
from server.continuous_batching.scheduling.block_manager import BlockManager
from server.continuous_batching.sequence import Sequence, SequenceGroup

EOS = 0
#: Id -> text; EOS decodes to nothing, like a special token with skip_special_tokens.
PIECES = ["", " the", " cat", " sat", " on", " mat", ".", " STOP", " dog", " ran"]
VOCAB = len(PIECES)
PROMPT = [1, 2, 3, 4, 5, 6]  # 6 tokens: one full block of 4 and half of another


class PieceTokenizer:
    """``decode`` joins the pieces; enough for ``IncrementalDetokenizer``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids)


class ListSampler:
    """``TokenSampler`` over plain lists: a row of "logits" is a list of ``VOCAB`` floats."""

    def __init__(self, failing_temperature: float | None = None) -> None:
        self.failing_temperature = failing_temperature
        self.num_reads = 0

    def sample(self, logits: Any, row_index: list[int], params: list[RowParams]) -> list[int]:
        if any(p.temperature == self.failing_temperature for p in params):
            raise IndexError("bad row (injected)")
        tokens = []
        for row, p in zip(row_index, params, strict=True):
            scores = list(logits[row])
            for token in p.banned_token_ids:
                scores[token] = float("-inf")
            tokens.append(max(range(VOCAB), key=scores.__getitem__))
        return tokens

    def read_tokens(self, tokens: list[int]) -> list[int]:
        self.num_reads += 1
        return list(tokens)

    def beam_candidates(
        self,
        logits: Any,
        row_index: list[int],
        params: list[RowParams],
        beam_scores: list[float],
        k: int,
    ) -> list[BeamCandidate]:
        """The rows are log-probs already; the prompt's single row stands for every beam."""
        rows = [logits[r] for r in row_index]
        rows = rows * len(beam_scores) if len(rows) == 1 else rows
        flat = [
            BeamCandidate(beam, token, float32(score + rows[beam][token]))
            for beam, score in enumerate(beam_scores)
            for token in range(VOCAB)
        ]
        return [flat[i] for i in topk_indices([c.score for c in flat], k)]


def one_hot(token: int) -> list[float]:
    return [1.0 if t == token else 0.0 for t in range(VOCAB)]


def preferring(*tokens: int) -> list[float]:
    """Logits that rank ``tokens`` first, in order (the rest far below)."""
    row = [-10.0] * VOCAB
    for rank, token in enumerate(tokens):
        row[token] = -float(rank)
    return row


def make(
    config: GenerationConfig, num_blocks: int = 16
) -> tuple[Decoder, SequenceGroup, BlockManager]:
    """A decoder and one admitted request whose prompt's KV is in the pool."""
    blocks = BlockManager(num_blocks, 0, block_size=4, watermark=0.0, enable_prefix_caching=False)
    decoder = Decoder(PieceTokenizer(), blocks, [EOS], ListSampler())
    seq = Sequence(list(PROMPT), len(PROMPT))
    blocks.allocate_slots(seq, len(PROMPT))
    seq.num_computed_tokens = len(PROMPT)
    group = SequenceGroup("r", [seq], config)
    decoder.start(group)
    return decoder, group, blocks


def step(decoder: Decoder, group: SequenceGroup, *rows: list[float]) -> list[RequestOutput]:
    """One engine step of ``group`` alone: its live sequences' rows are ``rows``."""
    seqs = [s for s in group.seqs if not s.is_finished]
    tokens = decoder.collect(decoder.launch([(group, seqs)], list(rows)))
    return tokens.outputs + decoder.finish_text(tokens)


def text_of(outputs: list[RequestOutput], index: int = 0) -> str:
    return "".join(d.text for o in outputs for d in o.deltas if d.index == index)


# -- stop rules ----------------------------------------------------------------------------
def test_stop_token_ids() -> None:
    config = GenerationConfig(max_new_tokens=4, stop_token_ids=[6])
    assert stop_token_ids_for(config, [EOS, 9]) == [EOS, 9, 6]
    assert stop_token_ids_for(config.model_copy(update={"ignore_eos": True}), [EOS]) == [6]


@pytest.mark.parametrize(
    ("token", "num_new", "reason"),
    [
        (8, 1, None),  # neither: runs on, blocks kept
        (8, 2, "length"),  # the budget
        (6, 1, "stop"),  # a stop id
        (EOS, 2, "stop"),  # a stop id on the last token: stop wins over the length
    ],
)
def test_append_token(token: int, num_new: int, reason: str | None) -> None:
    config = GenerationConfig(max_new_tokens=num_new + (reason is None), stop_token_ids=[6])
    decoder, group, blocks = make(config)
    (seq,) = group.seqs
    seq.token_ids.extend([9] * (num_new - 1))
    append_token(group, seq, token, blocks)
    assert seq.token_ids[-1] == token and seq.finish_reason == reason
    assert blocks.device.is_all_free() == (reason is not None)


def test_row_params_are_built_once_and_the_ban_lifts_at_min_new_tokens() -> None:
    config = GenerationConfig(max_new_tokens=9, min_new_tokens=2, repetition_penalty=1.2)
    _, group, _ = make(config)
    (seq,) = group.seqs
    row = row_params_for(group, seq)
    assert row.banned_token_ids == [EOS] and row.penalty_token_ids is seq.token_ids
    seq.token_ids.append(8)
    assert row_params_for(group, seq) is row and row.banned_token_ids == [EOS]
    seq.token_ids.append(9)  # two generated: min_new_tokens reached
    assert row_params_for(group, seq) is row and row.banned_token_ids == []
    assert row.penalty_token_ids == [*PROMPT, 8, 9]  # the live list, grown


def test_min_new_tokens_and_ignore_eos_through_the_decoder() -> None:
    decoder, group, _ = make(GenerationConfig(max_new_tokens=5, min_new_tokens=2))
    eos_first = preferring(EOS, 8)
    step(decoder, group, eos_first)  # EOS banned: the runner-up
    step(decoder, group, eos_first)
    outputs = step(decoder, group, eos_first)  # two generated: EOS allowed, and it stops
    assert group.seqs[0].token_ids[len(PROMPT) :] == [8, 8, EOS]
    assert outputs[0].deltas[0].finish_reason == "stop" and outputs[0].is_finished
    assert outputs[0].deltas[0].text == ""  # a stop id adds no text

    decoder, group, blocks = make(GenerationConfig(max_new_tokens=2, ignore_eos=True))
    step(decoder, group, one_hot(EOS))
    outputs = step(decoder, group, one_hot(EOS))
    assert group.seqs[0].num_generated == 2 and outputs[0].deltas[0].finish_reason == "length"
    assert blocks.device.is_all_free()


def test_stop_string_cuts_the_text_and_frees_the_blocks() -> None:
    decoder, group, blocks = make(GenerationConfig(max_new_tokens=8, stop=[" on"]))
    texts = [text_of(step(decoder, group, one_hot(token))) for token in (2, 3)]
    assert texts == [" cat", " sat"] and not blocks.device.is_all_free()
    (output,) = step(decoder, group, one_hot(4))  # " on": the stop string
    assert output.is_finished and output.deltas[0].finish_reason == "stop"
    assert output.deltas[0].text == "" and blocks.device.is_all_free()


# -- forks ---------------------------------------------------------------------------------
def test_fork_samples_shares_the_prompt_blocks() -> None:
    config = GenerationConfig(max_new_tokens=4, num_return_sequences=3, do_sample=True)
    _, group, blocks = make(config)
    (parent,) = group.seqs
    prompt_blocks = list(parent.block_table)
    children = fork_samples(group, parent, 3, blocks, lambda g: object())
    assert group.seqs == children and [c.choice_index for c in children] == [0, 1, 2]
    assert all(c.block_table == prompt_blocks for c in children) and parent.block_table == []
    assert [blocks.device.ref_counts[b] for b in prompt_blocks] == [3, 3]  # parent's gone
    assert len({id(c.detokenizer) for c in children}) == 3
    for child in children:
        blocks.free(child)
    assert blocks.device.is_all_free()


def test_fork_beams_follows_parents_and_frees_the_dropped_one() -> None:
    _, group, blocks = make(GenerationConfig(max_new_tokens=4, num_beams=3))
    (first,) = group.seqs
    a, b, c = fork_beams(group, [first], [(0, 7), (0, 8), (0, 9)], blocks)
    blocks.allocate_slots(b, 1)  # b writes: copy-on-write of the shared half-full block
    only_b = b.block_table[-1]
    # Row 0 (a) continues twice, row 1 (b) never: b's private block goes back.
    children = fork_beams(group, [a, b, c], [(0, 5), (2, 6), (0, 4)], blocks)
    assert [s.token_ids[len(PROMPT) :] for s in children] == [[7, 5], [9, 6], [7, 4]]
    assert blocks.device.ref_counts[only_b] == 0
    assert blocks.device.ref_counts[children[0].block_table[0]] == 3
    for child in children:
        blocks.free(child)
    assert blocks.device.is_all_free()


def test_n_samples_through_the_decoder() -> None:
    config = GenerationConfig(max_new_tokens=2, num_return_sequences=2, do_sample=True)
    decoder, group, blocks = make(config)
    (first,) = step(decoder, group, one_hot(2))  # one prompt row serves both choices
    assert [(d.index, d.text) for d in first.deltas] == [(0, " cat"), (1, " cat")]
    assert len(group.seqs) == 2 and not first.is_finished
    (last,) = step(decoder, group, one_hot(3), one_hot(EOS))
    assert [(d.index, d.text, d.finish_reason) for d in last.deltas] == [
        (0, " sat", "length"),
        (1, "", "stop"),
    ]
    assert last.is_finished and blocks.device.is_all_free()


# -- beams through the decoder -------------------------------------------------------------
def test_beams_fork_finish_and_make_text_once() -> None:
    config = GenerationConfig(max_new_tokens=2, num_beams=2, num_return_sequences=2)
    decoder, group, blocks = make(config)
    (first,) = step(decoder, group, [-1.0, -9.0, -0.25, -0.5, *[-9.0] * 6])
    assert first.deltas == [] and not first.is_finished
    assert [s.token_ids[len(PROMPT) :] for s in group.seqs] == [[2], [3]]
    rows = ([-9.0] * 4 + [-0.5, -1.0] + [-9.0] * 4, [-9.0] * 8 + [-0.25, -9.0])
    (last,) = step(decoder, group, *rows)
    # [2, 4] = -0.75 and [3, 8] = -0.75 tie; [2, 5] = -1.25 loses. Scores are / 2 tokens.
    assert last.is_finished and blocks.device.is_all_free()
    texts = {d.text for d in last.deltas}
    assert texts == {" cat on", " sat dog"} and [d.index for d in last.deltas] == [0, 1]
    assert all(d.finish_reason == "length" and d.num_new_tokens == 2 for d in last.deltas)


# -- failures ------------------------------------------------------------------------------
def test_a_failing_group_fails_alone() -> None:
    decoder, good, blocks = make(GenerationConfig(max_new_tokens=2))
    decoder.sampler = ListSampler(failing_temperature=0.5)
    bad_config = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=0.5)
    bad_seq = Sequence(list(PROMPT), len(PROMPT))
    blocks.allocate_slots(bad_seq, len(PROMPT))
    bad = SequenceGroup("bad", [bad_seq], bad_config)
    decoder.start(bad)
    sampled = decoder.launch([(good, good.seqs), (bad, bad.seqs)], [one_hot(2), one_hot(3)])
    tokens = decoder.collect(sampled)
    (failed,) = tokens.outputs
    assert failed.request_id == "bad" and failed.is_finished and "injected" in str(failed.error)
    assert [d.finish_reason for d in failed.deltas] == ["abort"] and bad_seq.block_table == []
    (ok,) = decoder.finish_text(tokens)
    assert ok.request_id == "r" and ok.deltas[0].text == " cat"  # the batch went on
    assert decoder.sampler.num_reads == 1  # the good group alone, one read back
