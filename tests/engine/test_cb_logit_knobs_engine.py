"""OpenAI's sampling knobs through the CB engine on the default model (float32): ``logit_bias``
forces and bans tokens, the frequency and presence penalties stop a repetition, the greedy
tokens equal transformers' ``generate`` with a reference processor of the definitions, and a
seeded ``min_p`` request draws the same tokens alone or in a batch."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from tests.engine.conftest import assert_no_leak, tokens_of
from tests.support.default_model import DEMO_QUESTION
from tests.support.logit_knobs_reference import reference_greedy

PARIS = 7042  # " Paris": greedy's sixth token answering the demo question
REPEATING = "1 1 1 1 1 1"  # greedy goes on with " 1" eight times in 16 tokens


@pytest.fixture
def engine(make_engine) -> LLMEngine:
    return make_engine(num_blocks=128)


def chat_ids(engine: LLMEngine, question: str = DEMO_QUESTION) -> list[int]:
    chat = [{"role": "user", "content": question}]
    prompt = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(prompt, add_special_tokens=False).input_ids


def greedy(**options: Any) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=options.pop("max_new_tokens", 10), **options)


def run(engine: LLMEngine, prompts: list[list[int]], configs: list[GenerationConfig]):
    results = [tokens_of(deltas) for deltas in engine.generate(prompts, configs)]
    assert_no_leak(engine)
    return results


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_it(engine: LLMEngine) -> None:
    prompt = chat_ids(engine)
    plain, forced, banned = run(
        engine,
        [prompt] * 3,
        [
            greedy(),
            greedy(max_new_tokens=5, ignore_eos=True, logit_bias={42: 100.0}),
            greedy(logit_bias={PARIS: -100.0}),
        ],
    )
    assert PARIS in plain[0]
    assert forced[0] == [42] * 5
    assert PARIS not in banned[0]
    position = plain[0].index(PARIS)
    assert banned[0][:position] == plain[0][:position], "the ban only matters where it bites"


@pytest.mark.parametrize("knob", ["frequency_penalty", "presence_penalty"])
def test_a_large_penalty_stops_a_repetition(engine: LLMEngine, knob: str) -> None:
    prompt = engine.tokenizer(REPEATING).input_ids
    options = {"max_new_tokens": 16, "ignore_eos": True}
    plain, penalised = run(
        engine, [prompt] * 2, [greedy(**options), greedy(**options, **{knob: 2.0})]
    )
    token, count = Counter(plain[0]).most_common(1)[0]
    assert count >= 8
    # The prompt's own " 1"s are not counted: the first generated " 1" is still allowed.
    assert Counter(penalised[0])[token] <= 1
    assert penalised[0][0] == plain[0][0]


def test_greedy_tokens_equal_transformers_with_the_reference(
    engine: LLMEngine, hf_model: Any
) -> None:
    """Rows with different knobs (and one without) in one batch: each gives the tokens of
    transformers' ``generate`` with a logits processor written from the definitions."""
    prompts = [
        chat_ids(engine),
        engine.tokenizer(REPEATING).input_ids,
        chat_ids(engine, "Write a haiku about the sea."),
        chat_ids(engine, "List three primary colors."),
    ]
    knobs: list[dict[str, Any]] = [
        {"logit_bias": {PARIS: -5.0, 504: 1.5}},
        {"frequency_penalty": 0.5, "presence_penalty": 0.3},
        {},
        {"frequency_penalty": 1.2, "presence_penalty": -0.4, "logit_bias": {30: 2.0}},
    ]
    num_new = 12
    results = run(
        engine, prompts, [greedy(max_new_tokens=num_new, ignore_eos=True, **k) for k in knobs]
    )
    for prompt, options, ours in zip(prompts, knobs, results, strict=True):
        assert ours[0] == reference_greedy(hf_model, prompt, num_new, **options), options
        if options:  # the knobs change these answers: the comparison is not a vacuous one
            assert ours[0] != reference_greedy(hf_model, prompt, num_new), options


def test_seeded_min_p_is_reproducible_alone_or_batched(engine: LLMEngine) -> None:
    prompt = chat_ids(engine, "Write a haiku about the sea.")
    seeded = GenerationConfig(
        max_new_tokens=12, do_sample=True, temperature=1.3, min_p=0.1, seed=1234
    )
    (alone,) = run(engine, [prompt], [seeded])
    others = [
        greedy(logit_bias={PARIS: 3.0}),
        GenerationConfig(max_new_tokens=8, do_sample=True, min_p=0.3),
        GenerationConfig(max_new_tokens=6, do_sample=True, frequency_penalty=1.0, seed=5),
    ]
    batched = run(engine, [chat_ids(engine)] * 2 + [prompt] * 2, [*others[:2], seeded, others[2]])
    assert batched[2] == alone
    (again,) = run(engine, [prompt], [seeded])
    assert again == alone
