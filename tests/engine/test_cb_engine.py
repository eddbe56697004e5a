"""The continuous-batching engine against transformers, with the real default model in float32.

Greedy must equal transformers token for token (alone and batched with other strategies),
beam search must equal transformers' beam search, seeded sampling must not depend on the batch,
and preemption (swap or recompute), chunked prefill, prefix caching and aborts must change
nothing but speed, and leak no block.
"""

from __future__ import annotations

import pytest

from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest
from server.continuous_batching.engine import EngineError
from tests.engine.conftest import NUM_NEW, assert_no_leak, hf_generate, tokens_of


def test_greedy_alone_matches_transformers(make_engine, prompts, hf_greedy) -> None:
    engine = make_engine()
    for prompt, expected in zip(prompts, hf_greedy, strict=True):
        (deltas,) = engine.generate([prompt], [GenerationConfig(max_new_tokens=NUM_NEW)])
        assert tokens_of(deltas)[0] == expected
    assert_no_leak(engine)


def test_greedy_batched_with_other_strategies_matches(make_engine, prompts, hf_greedy) -> None:
    engine = make_engine()
    greedy = GenerationConfig(max_new_tokens=NUM_NEW)
    others = [
        GenerationConfig(max_new_tokens=9, do_sample=True, temperature=0.8, top_p=0.9, seed=1),
        GenerationConfig(max_new_tokens=7, num_beams=3, num_return_sequences=2),
        GenerationConfig(max_new_tokens=5, do_sample=True, top_k=20, num_return_sequences=3),
        GenerationConfig(max_new_tokens=6, repetition_penalty=1.3),
    ]
    batch = prompts + prompts[:4]
    configs = [greedy] * len(prompts) + others
    results = engine.generate(batch, configs)
    for deltas, expected in zip(results, hf_greedy, strict=False):
        assert tokens_of(deltas)[0] == expected
    assert len(tokens_of(results[-2])) == 3 and len(tokens_of(results[-3])) == 2
    assert_no_leak(engine)


@pytest.mark.parametrize(
    ("num_beams", "num_return", "length_penalty", "early_stopping"),
    [(2, 1, 1.0, False), (3, 2, 0.5, True), (4, 4, 2.0, "never")],
)
def test_beam_search_matches_transformers(
    make_engine, prompts, hf_model, num_beams, num_return, length_penalty, early_stopping
) -> None:
    engine = make_engine()
    config = GenerationConfig(
        max_new_tokens=10,
        num_beams=num_beams,
        num_return_sequences=num_return,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    chosen = [prompts[0], prompts[3], prompts[12]]
    results = engine.generate(chosen, [config] * len(chosen))
    for prompt, deltas in zip(chosen, results, strict=True):
        expected = hf_generate(
            hf_model,
            prompt,
            max_new_tokens=10,
            num_beams=num_beams,
            num_return_sequences=num_return,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        got = tokens_of(deltas)
        for index, hf_tokens in enumerate(expected):
            mine = got[index]
            assert mine == hf_tokens[: len(mine)] and all(t == 2 for t in hf_tokens[len(mine) :])
    assert_no_leak(engine)


def test_seeded_sampling_does_not_depend_on_the_batch(make_engine, prompts) -> None:
    engine = make_engine()
    seeded = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.0, seed=1234)
    (alone,) = engine.generate([prompts[1]], [seeded])
    noise = GenerationConfig(max_new_tokens=14, do_sample=True, temperature=0.9)
    mixed = engine.generate(
        [prompts[2], prompts[1], prompts[3]], [noise, seeded, GenerationConfig(max_new_tokens=4)]
    )
    assert tokens_of(mixed[1]) == tokens_of(alone)
    assert_no_leak(engine)


@pytest.mark.parametrize(
    ("cache", "kind"),
    [
        ({"num_blocks": 10, "num_blocks_cpu": 64}, "swap"),
        ({"num_blocks": 10, "num_blocks_cpu": 0}, "recompute"),
    ],
)
def test_preemption_gives_the_same_tokens(make_engine, prompts, hf_greedy, cache, kind) -> None:
    engine = make_engine(**cache, watermark=0.0, enable_prefix_caching=False)
    configs = [GenerationConfig(max_new_tokens=2 * NUM_NEW, ignore_eos=True)] * 6
    results = engine.generate(prompts[:6], configs)
    stats = engine.stats
    assert (stats.num_swap_preemptions if kind == "swap" else stats.num_recompute_preemptions) > 0
    for deltas, expected in zip(results, hf_greedy, strict=False):
        got = tokens_of(deltas)[0]
        upto_eos = expected[: expected.index(2)] if 2 in expected else expected
        assert got[: len(upto_eos)] == upto_eos
    assert_no_leak(engine)


def test_chunked_prefill_and_prefix_cache_change_nothing(make_engine, prompts, hf_greedy) -> None:
    engine = make_engine(batch_max_tokens=16)
    config = GenerationConfig(max_new_tokens=NUM_NEW)
    first = engine.generate(prompts[:3], [config] * 3)
    num_hits_before = engine.block_manager.num_prefix_hit_tokens
    second = engine.generate(prompts[:3], [config] * 3)  # same prompts: prefix blocks reused
    for a, b, expected in zip(first, second, hf_greedy, strict=False):
        assert tokens_of(a)[0] == tokens_of(b)[0] == expected
    assert engine.block_manager.num_prefix_hit_tokens - num_hits_before >= 3 * 16
    assert_no_leak(engine)


def test_stops_abort_and_refusals(make_engine, prompts) -> None:
    engine = make_engine()
    (deltas,) = engine.generate([prompts[0]], [GenerationConfig(max_new_tokens=20, stop=["Paris"])])
    assert "".join(d.text for d in deltas) == "The capital of France is "
    assert deltas[-1].finish_reason == "stop"
    (deltas,) = engine.generate(
        [prompts[0]], [GenerationConfig(max_new_tokens=20, min_new_tokens=15)]
    )
    assert sum(d.num_new_tokens for d in deltas) >= 15
    config = GenerationConfig(max_new_tokens=200, ignore_eos=True)
    engine.add_request(SequenceRequest("long", prompts[1], config))
    for _ in range(3):
        engine.step()
    closing = engine.abort("long")
    assert closing is not None and closing.deltas[0].finish_reason == "abort"
    assert_no_leak(engine)
    with pytest.raises(EngineError, match="exceeds the context of 8192 tokens") as refused:
        engine.add_request(
            SequenceRequest("huge", prompts[0], GenerationConfig(max_new_tokens=9000))
        )
    assert refused.value.status_code == 400 and "8192" in refused.value.message
