"""The CB sampler against transformers' logits processors, and its per-request reproducibility."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.sampling.beam_candidates import beam_log_probs
from server.continuous_batching.sampling.draws import choose, choose_all, make_generator, sample
from server.continuous_batching.sampling.logprobs import token_logprobs
from server.continuous_batching.sampling.processors import process_logits
from server.continuous_batching.sampling.sampler import LogitsSampler

V = 1000
PENALTY_IDS = [5, 17, 17, 250, 999, 0, 42, 5]  # duplicates on purpose: penalised once
BANNED = [3, 7, 11]


def random_logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    """Peaked random logits (scale 3) so that top-p and typical-p really cut."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3.0


def sampled(**kwargs: object) -> RowParams:
    return RowParams(is_greedy=False, **kwargs)  # type: ignore[arg-type]


def hf_process(
    logits: torch.Tensor, processors: list[LogitsProcessor], input_ids: list[int]
) -> torch.Tensor:
    """Apply HF processors, in order, to a single row."""
    ids = torch.tensor([input_ids], dtype=torch.long)
    scores = logits.clone()
    for processor in processors:
        scores = processor(ids, scores)
    return scores


# (our row, HF's processors in generate's order). HF's MinNewTokens bans at 0 of 5 new tokens.
SINGLE_TRANSFORMS = {
    "penalty_up": (
        RowParams(repetition_penalty=1.3, penalty_token_ids=PENALTY_IDS),
        [RepetitionPenaltyLogitsProcessor(1.3)],
    ),
    "penalty_down": (
        sampled(repetition_penalty=0.7, penalty_token_ids=PENALTY_IDS),
        [RepetitionPenaltyLogitsProcessor(0.7)],
    ),
    "banned": (
        RowParams(banned_token_ids=BANNED),
        [MinNewTokensLengthLogitsProcessor(len(PENALTY_IDS), 5, BANNED)],
    ),
    "temperature": (sampled(temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    "top_k": (sampled(top_k=10), [TopKLogitsWarper(10)]),
    "top_k_1": (sampled(top_k=1), [TopKLogitsWarper(1)]),
    "top_p": (sampled(top_p=0.8), [TopPLogitsWarper(0.8)]),
    "top_p_tiny": (sampled(top_p=0.01), [TopPLogitsWarper(0.01)]),
    "typical_p": (sampled(typical_p=0.5), [TypicalLogitsWarper(0.5)]),
    "typical_p_tiny": (sampled(typical_p=0.01), [TypicalLogitsWarper(0.01)]),
    "all": (
        sampled(
            temperature=0.8,
            top_k=50,
            top_p=0.9,
            typical_p=0.9,
            repetition_penalty=1.2,
            penalty_token_ids=PENALTY_IDS,
            banned_token_ids=BANNED,
        ),
        [
            RepetitionPenaltyLogitsProcessor(1.2),
            MinNewTokensLengthLogitsProcessor(len(PENALTY_IDS), 5, BANNED),
            TemperatureLogitsWarper(0.8),
            TopKLogitsWarper(50),
            TopPLogitsWarper(0.9),
            TypicalLogitsWarper(0.9),
        ],
    ),
}


def assert_same_scores(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("name", list(SINGLE_TRANSFORMS))
def test_each_transform_matches_transformers(name: str) -> None:
    row, processors = SINGLE_TRANSFORMS[name]
    logits = random_logits(1, seed=len(name))
    ours = process_logits(logits, [row])
    assert_same_scores(ours, hf_process(logits, processors, PENALTY_IDS))
    assert not torch.isinf(logits).any(), "process_logits must not modify its input"


def test_warpers_are_ignored_for_greedy_rows() -> None:
    """HF only applies warpers with do_sample; greedy rows see the processors alone."""
    logits = random_logits(1)
    row = RowParams(is_greedy=True, temperature=0.5, top_k=3, top_p=0.5, typical_p=0.5)
    assert torch.equal(process_logits(logits, [row]), logits)


def test_mixed_batch_equals_rows_alone() -> None:
    rows = [row for row, _ in SINGLE_TRANSFORMS.values()] + [RowParams(), sampled()]
    logits = random_logits(len(rows), seed=1)
    batch = process_logits(logits, rows)
    for i, row in enumerate(rows):
        alone = process_logits(logits[i : i + 1], [row])
        assert torch.equal(batch[i : i + 1], alone), f"row {i} differs in a batch"


def test_greedy_is_argmax_and_respects_processors() -> None:
    logits = random_logits(6, seed=2)
    assert torch.equal(sample(logits, [RowParams()] * 6), logits.argmax(dim=-1))
    best = logits.argmax(dim=-1).tolist()
    rows = [RowParams(banned_token_ids=[t]) for t in best]
    tokens = sample(logits, rows).tolist()
    assert all(t != b for t, b in zip(tokens, best, strict=True))
    expected = [
        int(logits[i].clone().index_fill_(0, torch.tensor([b]), -1e30).argmax())
        for i, b in enumerate(best)
    ]
    assert tokens == expected


def _mixed_rows(seed: int) -> list[RowParams]:
    """Plain greedy rows around rows that process their logits, sampled ones seeded."""
    return [
        RowParams(),
        sampled(generator=make_generator(seed, "cpu"), top_k=50),
        RowParams(),
        RowParams(repetition_penalty=1.3, penalty_token_ids=PENALTY_IDS),
        RowParams(logit_bias={7: 100.0}),
        sampled(generator=make_generator(seed + 1, "cpu"), min_p=0.1, temperature=0.7),
        RowParams(),
        RowParams(banned_token_ids=BANNED),
    ]


def test_greedy_fast_path_equals_the_full_path() -> None:
    """A mixed batch: the plain greedy rows take their argmax alone and only the others are
    processed (``_choose``); tokens and, when asked, scores equal processing every row."""
    logits = random_logits(8, seed=5)
    fast_tokens, no_scores = choose(logits, _mixed_rows(3))
    full_tokens, full_scores = choose_all(logits, _mixed_rows(3))
    assert no_scores is None
    assert torch.equal(fast_tokens, full_tokens)
    assert torch.equal(fast_tokens[[0, 2, 6]], logits[[0, 2, 6]].argmax(dim=-1))
    tokens, scores = choose(logits, _mixed_rows(3), need_scores=True)
    assert torch.equal(tokens, full_tokens) and torch.equal(scores, full_scores)


def test_logits_sampler_greedy_rows_pick_ids_not_rows() -> None:
    """``LogitsSampler.sample`` of plain greedy rows, in any row order and subset, equals the
    argmax of the gathered rows; mixed rows and processed logprobs equal the full path."""
    logits = random_logits(6, seed=6)
    picker = LogitsSampler()
    for row_index in ([0, 1, 2, 3, 4, 5], [5, 0, 3, 1], [4]):
        got = picker.sample(logits, row_index, [RowParams()] * len(row_index))
        assert torch.equal(got, logits[row_index].argmax(dim=-1))
    rows = _mixed_rows(4)[:6]
    for row in rows:
        row.logprobs, row.logprobs_mode = 2, "processed"
    queued = picker.sample(logits, list(range(6)), rows)
    tokens, scores = choose_all(logits, _mixed_rows(4)[:6])
    assert torch.equal(queued.tokens, tokens)
    want = token_logprobs(logits, scores, tokens, rows)[2]
    assert torch.equal(queued.table, want)


def test_temperature_zero_is_greedy() -> None:
    logits = random_logits(3, seed=3)
    tokens = sample(logits, [sampled(temperature=0.0)] * 3)
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_beam_log_probs_match_transformers() -> None:
    """Beam search: log_softmax first, then penalty and EOS ban on the log-probs (as HF)."""
    logits = random_logits(2, seed=4)
    row = RowParams(repetition_penalty=1.5, penalty_token_ids=PENALTY_IDS, banned_token_ids=[2])
    ours = beam_log_probs(logits, [row, RowParams()])
    processors = [
        RepetitionPenaltyLogitsProcessor(1.5),
        MinNewTokensLengthLogitsProcessor(len(PENALTY_IDS), 1, [2]),
    ]
    log_probs = torch.log_softmax(logits, dim=-1)
    assert_same_scores(ours[:1], hf_process(log_probs[:1], processors, PENALTY_IDS))
    assert torch.equal(ours[1:], log_probs[1:])


def run_steps(target_position: int, others: list[RowParams], steps: int = 20) -> list[int]:
    """Tokens drawn for a seeded top-k/top-p row placed among ``others``, over ``steps``."""
    target = sampled(temperature=0.9, top_k=100, top_p=0.95, generator=make_generator(1234, "cpu"))
    rows = list(others)
    rows.insert(target_position, target)
    out = []
    for step in range(steps):
        # The target's logits are the same in every batch; the others' differ per batch.
        logits = random_logits(len(rows), seed=100 + step + 1000 * len(rows))
        logits[target_position] = random_logits(1, seed=step)[0]
        out.append(int(sample(logits, rows)[target_position]))
    return out


def test_seed_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(0)
    alone = run_steps(0, [])
    others = [
        sampled(generator=make_generator(1, "cpu")),
        RowParams(),
        sampled(top_p=0.5),  # global RNG
        sampled(typical_p=0.7, generator=make_generator(1234, "cpu")),  # same seed, own stream
    ]
    assert run_steps(2, others) == alone
    assert run_steps(4, others[::-1]) == alone
    assert len(set(alone)) > 5, "a sampled row should not be constant"
    torch.manual_seed(1)
    assert run_steps(0, []) == alone, "the global RNG must not influence a seeded row"


def test_rows_sharing_a_generator_draw_in_row_order() -> None:
    """num_return_sequences > 1: one generator per request, its rows draw in row order."""

    def request_tokens(layout: list[str]) -> list[list[int]]:
        generator = make_generator(7, "cpu")
        rows = [sampled(generator=generator) if k == "a" else sampled() for k in layout]
        mine = [i for i, k in enumerate(layout) if k == "a"]
        out = []
        for step in range(10):
            logits = random_logits(len(rows), seed=500 + step + 100 * len(rows))
            for j, i in enumerate(mine):
                logits[i] = random_logits(1, seed=step * 10 + j)[0]
            tokens = sample(logits, rows)
            out.append([int(tokens[i]) for i in mine])
        return out

    assert request_tokens(["a", "a"]) == request_tokens(["x", "a", "x", "a", "x"])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("row", [sampled(), sampled(temperature=1.5, top_k=5, top_p=0.9)])
def test_sampling_frequencies_follow_probabilities(row: RowParams) -> None:
    logits = random_logits(1, seed=5, vocab=8) / 2.0
    probs = torch.softmax(process_logits(logits, [row]), dim=-1)[0]
    n = 20000
    torch.manual_seed(0)  # unseeded rows: one batched draw over n identical rows
    counts = torch.bincount(sample(logits.expand(n, -1), [row] * n), minlength=8).float()
    # 7 degrees of freedom: P(chi2 > 30) is about 1e-4.
    assert chi_square(counts, probs) < 30.0
    seeded = dataclasses.replace(row, generator=make_generator(3, "cpu"))
    draws = [int(sample(logits, [seeded])) for _ in range(3000)]
    assert chi_square(torch.bincount(torch.tensor(draws), minlength=8).float(), probs) < 30.0


def test_banned_ids_are_never_sampled() -> None:
    logits = random_logits(1, seed=6, vocab=50)
    logits[0, BANNED] = 50.0  # by far the likeliest tokens
    n = 5000
    torch.manual_seed(0)
    tokens = sample(logits.expand(n, -1), [sampled(banned_token_ids=BANNED, temperature=2.0)] * n)
    assert not torch.isin(tokens, torch.tensor(BANNED)).any()


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    a, b = make_generator(9, "cpu"), make_generator(9, torch.device("cpu"))
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_row_params_from_generation_config() -> None:
    from protocol.generation import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=0.5, top_k=7, repetition_penalty=1.1)
    row = RowParams.from_generation_config(config, banned_token_ids=[2], penalty_token_ids=[1])
    assert row.samples and row.top_k == 7 and row.penalised and row.banned_token_ids == [2]
    beam = RowParams.from_generation_config(GenerationConfig(num_beams=2, top_k=3))
    assert beam.is_greedy and not beam.penalised
