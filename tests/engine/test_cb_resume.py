"""A choice resumed on the CB engine from the tokens another engine streamed (the gateway's
mid-stream resume, ``protocol.resume``) continues exactly as the undisturbed run: greedy and
seeded sampling token for token, the text with no character missing or repeated, stop strings
that straddle the switch, ``min_new_tokens`` and the output penalties keeping their meaning;
and the keyed seeded draws give each choice of ``n`` the same tokens alone or together."""

from __future__ import annotations

import pytest

from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest, TextDelta
from server.continuous_batching.decoding.draw_keys import draw_key
from server.continuous_batching.engine import LLMEngine
from tests.engine.conftest import assert_no_leak, tokens_of


@pytest.fixture
def engine(make_engine) -> LLMEngine:
    return make_engine(num_blocks=128)


def _run(engine: LLMEngine, request: SequenceRequest) -> list[TextDelta]:
    engine.add_request(request)
    deltas: list[TextDelta] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas.extend(output.deltas)
    return deltas


def _resumed_at(
    engine: LLMEngine, prompt: list[int], config: GenerationConfig, whole: list[TextDelta], k: int
) -> tuple[list[int], str, str | None]:
    """Resume ``whole`` (a one-choice run, one delta per token) after its first ``k`` tokens;
    the tokens and text the resumed run adds, and its finish reason."""
    ids = [t for d in whole[:k] for t in d.token_ids]
    num_chars = sum(len(d.text) for d in whole[:k])
    request = SequenceRequest(
        f"resumed-{k}", prompt, config, resumed_token_ids=ids, num_resumed_text_chars=num_chars
    )
    deltas = _run(engine, request)
    assert all(d.index == 0 for d in deltas)
    return tokens_of(deltas)[0], "".join(d.text for d in deltas), deltas[-1].finish_reason


@pytest.mark.parametrize(
    "config",
    [
        GenerationConfig(max_new_tokens=14, ignore_eos=True),
        GenerationConfig(max_new_tokens=14, do_sample=True, temperature=0.9, seed=7, top_k=50),
        GenerationConfig(
            max_new_tokens=14, min_new_tokens=10, presence_penalty=1.2, frequency_penalty=0.4
        ),
    ],
    ids=["greedy", "seeded", "penalties+min_tokens"],
)
def test_a_resumed_choice_continues_the_undisturbed_one(
    engine: LLMEngine, prompts: list[list[int]], config: GenerationConfig
) -> None:
    prompt = prompts[1]
    whole = _run(engine, SequenceRequest("whole", prompt, config))
    tokens = tokens_of(whole)[0]
    text = "".join(d.text for d in whole)
    for k in (1, 5, len(tokens) - 1):
        rest, rest_text, reason = _resumed_at(engine, prompt, config, whole, k)
        assert tokens[:k] + rest == tokens, k
        assert text[: sum(len(d.text) for d in whole[:k])] + rest_text == text, k
        assert reason == whole[-1].finish_reason
    assert_no_leak(engine)


def test_a_stop_string_that_straddles_the_switch_still_stops(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    prompt = prompts[0]
    free = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    text = "".join(d.text for d in _run(engine, SequenceRequest("free", prompt, free)))
    stop = text[8:14]  # a stop string somewhere in the middle of the answer
    config = free.model_copy(update={"stop": [stop]})
    whole = _run(engine, SequenceRequest("stopped", prompt, config))
    expected = "".join(d.text for d in whole)
    assert expected == text[: text.index(stop)] and whole[-1].finish_reason == "stop"
    # Resume after each token up to the stop: the held-back start of the stop string, if
    # any, comes from the new engine, which cuts it when the stop string completes.
    for k in range(1, len(whole)):
        _, rest_text, reason = _resumed_at(engine, prompt, config, whole, k)
        assert expected[: sum(len(d.text) for d in whole[:k])] + rest_text == expected, k
        assert reason == "stop", k
    assert_no_leak(engine)


def test_seeded_choices_draw_by_their_own_key(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """Choice j of an n=3 seeded request == the same request resumed as choice j alone
    from its first token (the keys are (seed, choice, position), not a shared stream)."""
    prompt = prompts[2]
    config = GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=1.0, seed=3, num_return_sequences=3
    )
    together = tokens_of(_run(engine, SequenceRequest("n3", prompt, config)))
    assert len({tuple(t) for t in together.values()}) > 1, "three draws, not one"
    alone = config.model_copy(update={"num_return_sequences": 1})
    for j, tokens in together.items():
        request = SequenceRequest(
            f"choice-{j}", prompt, alone, resumed_token_ids=tokens[:1], choice_index=j
        )
        assert tokens[:1] + tokens_of(_run(engine, request))[0] == tokens, j
    assert_no_leak(engine)


def test_draw_keys_differ_by_seed_choice_and_position() -> None:
    keys = {draw_key(s, c, p) for s in (0, 1) for c in (0, 1, 2) for p in range(50)}
    assert len(keys) == 2 * 3 * 50
    assert all(0 <= k < 2**63 for k in keys)
    assert draw_key(5, 1, 7) == draw_key(5, 1, 7)
