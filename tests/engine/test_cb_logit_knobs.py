"""OpenAI's sampling knobs in the CB sampler (``logit_bias``, ``presence_penalty``,
``frequency_penalty``, ``min_p``), each against a plain torch reference of its definition, row
by row, in batches where rows differ and some rows do not use the knob. No model needed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from protocol.generation import GenerationConfig
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.draws import make_generator, sample
from server.continuous_batching.sampling.processors import process_logits
from tests.support.logit_knobs_reference import ref_additive_penalties, ref_logit_bias, ref_min_p

V = 1000
PROMPT = [5, 17, 250, 42]
OUTPUT = [17, 17, 999, 0, 17, 42, 300]  # 17 three times; 42 also in the prompt
TOKENS = PROMPT + OUTPUT


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """Peaked random logits (scale 3) so that min-p really cuts."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=generator) * 3.0


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours, theirs), (ours - theirs).abs().nan_to_num().max()


# -- each knob, several settings in one batch ---------------------------------------------


def test_logit_bias_matches_its_definition() -> None:
    biases = [
        {3: 100.0, 17: -100.0},
        {},  # no bias: untouched
        {0: 0.5, 999: -0.25, 500: 7.0},
        {3: -3.5},  # the same token as row 0, another bias
    ]
    rows = [RowParams(logit_bias=b) for b in biases[:2]] + [
        RowParams(is_greedy=False, logit_bias=b) for b in biases[2:]
    ]
    logits = random_logits(len(rows), seed=1)
    ours = process_logits(logits, rows)
    for i, bias in enumerate(biases):
        assert_same(ours[i], ref_logit_bias(logits[i], bias))
    assert not torch.equal(ours[0], logits[0])


def test_allowed_token_ids_keep_only_their_scores() -> None:
    """vLLM's ``allowed_token_ids``: the row's other tokens score -inf, its allowed ones and
    the other rows stay bit for bit (a bias on an allowed token still applies after it)."""
    rows = [
        RowParams(allowed_token_ids=[3, 999, 17]),
        RowParams(),  # not limited: untouched
        RowParams(allowed_token_ids=[0], logit_bias={0: 2.0, 5: 1.0}),
    ]
    logits = random_logits(len(rows), seed=4)
    ours = process_logits(logits, rows)
    expected = torch.full((V,), float("-inf"))
    expected[[3, 999, 17]] = logits[0, [3, 999, 17]]
    assert_same(ours[0], expected)
    assert_same(ours[1], logits[1])
    assert ours[2, 0] == logits[2, 0] + 2.0 and torch.isinf(ours[2, 1:]).all()
    assert ours[0].argmax().item() in (3, 999, 17)


def test_presence_and_frequency_count_generated_tokens_only() -> None:
    settings = [(0.5, 0.0), (0.0, 1.5), (-2.0, 2.0), (0.0, 0.0), (1.0, -0.5)]
    rows = [
        RowParams(
            presence_penalty=presence,
            frequency_penalty=frequency,
            penalty_token_ids=TOKENS,
            num_prompt_tokens=len(PROMPT),
            is_greedy=i % 2 == 0,
        )
        for i, (presence, frequency) in enumerate(settings)
    ]
    logits = random_logits(len(rows), seed=2)
    ours = process_logits(logits, rows)
    for i, (presence, frequency) in enumerate(settings):
        assert_same(ours[i], ref_additive_penalties(logits[i], OUTPUT, frequency, presence))
    # Prompt-only tokens (5, 250) keep their logits: the prompt is not counted.
    assert torch.equal(ours[:, [5, 250]], logits[:, [5, 250]])
    # 17 (three times) lost 3 * 1.5 in row 1, 42 (once) 1.5.
    assert torch.allclose(logits[1, [17, 42]] - ours[1, [17, 42]], torch.tensor([4.5, 1.5]))


def test_penalties_wait_for_generated_tokens() -> None:
    """Before the first generated token there is nothing to count: the row is untouched."""
    row = RowParams(presence_penalty=2.0, frequency_penalty=2.0, penalty_token_ids=PROMPT)
    row.num_prompt_tokens = len(PROMPT)
    assert not row.output_penalised and not row.processes_logits
    logits = random_logits(1, seed=3)
    assert torch.equal(process_logits(logits, [row]), logits)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_min_p_matches_its_definition_after_the_temperature(temperature: float) -> None:
    values = [0.05, 0.0, 0.3, 1.0, 0.0001]
    rows = [RowParams(is_greedy=False, temperature=temperature, min_p=m) for m in values]
    logits = random_logits(len(rows), seed=4)
    ours = process_logits(logits, rows)
    for i, min_p in enumerate(values):
        scaled = TemperatureLogitsWarper(temperature)(None, logits[i : i + 1].clone())[0]
        expected = ref_min_p(scaled, min_p) if min_p else scaled
        assert_same(ours[i], expected)
        if min_p:  # transformers' warper agrees (one row, min_tokens_to_keep=1)
            assert_same(ours[i : i + 1], MinPLogitsWarper(min_p)(None, scaled[None].clone()))
    kept = (~torch.isinf(ours)).sum(dim=-1).tolist()
    assert kept[1] == V and kept[3] == 1 and 1 < kept[0] < V


def test_min_p_is_ignored_by_greedy_rows() -> None:
    logits = random_logits(2, seed=5)
    rows = [RowParams(min_p=0.5), RowParams(min_p=0.5, temperature=0.0, is_greedy=False)]
    assert not any(row.processes_logits for row in rows)
    assert torch.equal(process_logits(logits, rows), logits)
    assert torch.equal(sample(logits, rows), logits.argmax(dim=-1))


def test_every_knob_together_in_vllms_order() -> None:
    """logit_bias, repetition penalty, frequency/presence, min_new_tokens ban, temperature,
    min_p, top-k, top-p: the row equals the definitions chained in that order, and rows
    without the new knobs still equal transformers' processors alone."""
    bias = {17: 2.0, 3: 100.0, 8: -1.0}
    # The knobs transformers has too; the full row adds the OpenAI ones to them.
    hf_knobs: dict[str, Any] = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
    hf_knobs.update(repetition_penalty=1.3, penalty_token_ids=TOKENS)
    hf_only = RowParams(is_greedy=False, num_prompt_tokens=len(PROMPT), **hf_knobs)
    full = replace(hf_only, min_p=0.02, presence_penalty=0.4, frequency_penalty=0.7)
    full = replace(full, logit_bias=bias, banned_token_ids=[2])
    logits = random_logits(3, seed=6)
    ours = process_logits(logits, [full, RowParams(), hf_only])
    ids = torch.tensor([TOKENS])

    def hf(row: torch.Tensor, *processors: object) -> torch.Tensor:
        scores = row[None].clone()
        for processor in processors:
            scores = processor(ids, scores)  # type: ignore[operator]
        return scores[0]

    expected = ref_logit_bias(logits[0], bias)
    expected = hf(expected, RepetitionPenaltyLogitsProcessor(1.3))
    expected = ref_additive_penalties(expected, OUTPUT, 0.7, 0.4)
    expected = hf(expected, MinNewTokensLengthLogitsProcessor(len(TOKENS), 5, [2]))
    expected = ref_min_p(hf(expected, TemperatureLogitsWarper(0.8)), 0.02)
    expected = hf(expected, TopKLogitsWarper(50), TopPLogitsWarper(0.9))
    assert_same(ours[0], expected)
    assert torch.equal(ours[1], logits[1])
    plain = hf(
        logits[2],
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.8),
        TopKLogitsWarper(50),
        TopPLogitsWarper(0.9),
    )
    assert_same(ours[2], plain)


def test_a_batch_equals_its_rows_alone() -> None:
    rows = [
        RowParams(logit_bias={1: 3.0}),
        RowParams(is_greedy=False, min_p=0.1, temperature=0.7, top_k=20),
        RowParams(),
        RowParams(
            is_greedy=False,
            frequency_penalty=1.0,
            presence_penalty=0.5,
            penalty_token_ids=TOKENS,
            num_prompt_tokens=len(PROMPT),
            logit_bias={17: 1.0},
        ),
        RowParams(is_greedy=False, top_p=0.8),
    ]
    logits = random_logits(len(rows), seed=7)
    batch = process_logits(logits, rows)
    for i, row in enumerate(rows):
        assert torch.equal(batch[i : i + 1], process_logits(logits[i : i + 1], [row])), i


# -- what the knobs do to the chosen token -------------------------------------------------


def test_greedy_rows_follow_bias_and_penalties() -> None:
    logits = random_logits(4, seed=8)
    best = logits.argmax(dim=-1).tolist()
    forced, banned = 123, best[1]
    repeated = best[2]
    rows = [
        RowParams(logit_bias={forced: 100.0}),
        RowParams(logit_bias={banned: -100.0}),
        RowParams(
            frequency_penalty=2.0,
            penalty_token_ids=[*PROMPT, *[repeated] * 20],
            num_prompt_tokens=len(PROMPT),
        ),
        RowParams(),
    ]
    tokens = sample(logits, rows).tolist()
    assert tokens[0] == forced
    assert tokens[1] != banned
    assert tokens[1] == int(ref_logit_bias(logits[1], {banned: -100.0}).argmax())
    assert tokens[2] != repeated
    assert tokens[3] == best[3]


def test_sampled_rows_follow_the_bias() -> None:
    logits = random_logits(1, seed=9)
    n = 200
    torch.manual_seed(0)
    forced = sample(logits.expand(n, -1), [RowParams(is_greedy=False, logit_bias={7: 100.0})] * n)
    assert forced.eq(7).all()
    best = int(logits.argmax())
    cold = RowParams(is_greedy=False, temperature=0.05, logit_bias={best: -100.0})
    assert not sample(logits.expand(n, -1), [cold] * n).eq(best).any()


def test_seeded_min_p_is_reproducible_in_any_batch() -> None:
    def draws(position: int, others: list[RowParams]) -> list[int]:
        target = RowParams(is_greedy=False, min_p=0.05, generator=make_generator(11, "cpu"))
        rows = list(others)
        rows.insert(position, target)
        out = []
        for step in range(15):
            logits = random_logits(len(rows), seed=1000 + step + 100 * len(rows))
            logits[position] = random_logits(1, seed=step)[0]
            out.append(int(sample(logits, rows)[position]))
        return out

    alone = draws(0, [])
    others = [RowParams(logit_bias={1: 1.0}), RowParams(is_greedy=False, min_p=0.3)]
    assert draws(1, others) == alone == draws(2, others[::-1])
    assert len(set(alone)) > 3


def test_row_params_carry_the_knobs() -> None:
    config = GenerationConfig(
        do_sample=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_p=0.1,
        logit_bias={"7": 2.5},  # type: ignore[dict-item]
    )
    row = RowParams.from_generation_config(config, penalty_token_ids=TOKENS, num_prompt_tokens=4)
    assert (row.presence_penalty, row.frequency_penalty, row.min_p) == (0.5, -0.5, 0.1)
    assert row.logit_bias == {7: 2.5} and row.output_penalised and not row.penalised
    plain = RowParams.from_generation_config(GenerationConfig(), penalty_token_ids=TOKENS)
    assert plain.penalty_token_ids is None and not plain.processes_logits


def test_bad_words_ban_a_last_token_only_after_the_rest() -> None:
    """vLLM's ``bad_words``: a one-token word is always banned; a longer word's last token
    only where the output (never the prompt) ends with the word's other tokens."""
    prompt = [5, 6]
    words = [[9], [6, 7], [1, 2, 3]]
    rows = [
        RowParams(bad_words_ids=words, penalty_token_ids=[*prompt], num_prompt_tokens=2),
        RowParams(bad_words_ids=words, penalty_token_ids=[*prompt, 6], num_prompt_tokens=2),
        RowParams(bad_words_ids=words, penalty_token_ids=[*prompt, 1, 2], num_prompt_tokens=2),
        RowParams(bad_words_ids=words, penalty_token_ids=[*prompt, 2, 1], num_prompt_tokens=2),
        RowParams(),
    ]
    logits = random_logits(len(rows), seed=5)
    ours = process_logits(logits, rows)
    # Row 0: only the prompt ends with 6, so 7 stays; rows 1 and 2 end with a word's start.
    banned = [{9}, {9, 7}, {9, 3}, {9}, set()]
    for i, ids in enumerate(banned):
        expected = logits[i].clone()
        expected[list(ids)] = float("-inf")
        assert_same(ours[i], expected)
