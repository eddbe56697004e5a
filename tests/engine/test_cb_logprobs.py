"""Logprobs on the CB engine against transformers on the same (float32) weights: the greedy
tokens' logprobs and their top-N equal ``log_softmax`` of transformers' logits to 1e-4 at every
step (teacher-forced on the generated ids), raw by default; the processed mode of a sampled row
equals ``log_softmax(logits / temperature)``; asking for logprobs changes no token."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from protocol.generation import GenerationConfig, TokenLogprob
from server.continuous_batching.engine import LLMEngine
from tests.engine.conftest import assert_no_leak, tokens_of

TOLERANCE = 1e-4
NUM_NEW = 8


@pytest.fixture
def engine(make_engine) -> LLMEngine:
    return make_engine(num_blocks=128)


def _entries(deltas) -> dict[int, list[TokenLogprob]]:
    out: dict[int, list[TokenLogprob]] = {}
    for delta in deltas:
        assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
        out.setdefault(delta.index, []).extend(delta.logprobs)
    return out


def _reference(hf_model: Any, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax before each generated token, ``[len(generated), V]``
    (one teacher-forced forward over the prompt and the generated ids)."""
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + len(generated)], dim=-1)


def _assert_close(entries: list[TokenLogprob], tokens: list[int], reference: torch.Tensor) -> None:
    for step, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        row = reference[step]
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < TOLERANCE, step
        expected = torch.topk(row, len(entry.top_logprobs)).values.tolist()
        got = [t.logprob for t in entry.top_logprobs]
        assert got == pytest.approx(expected, abs=TOLERANCE), step
        for alternative in entry.top_logprobs:  # ties may order ids differently: check each
            assert abs(alternative.logprob - row[alternative.token_id].item()) < TOLERANCE


def test_greedy_logprobs_equal_transformers(
    engine: LLMEngine, hf_model: Any, prompts: list[list[int]]
) -> None:
    chosen = [prompts[0], prompts[3], prompts[-4]]
    plain = [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(chosen)
    asking = [
        GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True, logprobs=n) for n in (5, 0, 20)
    ]
    # One batch: rows that ask and one that does not, side by side.
    results = engine.generate([*chosen, chosen[0]], [*asking, plain[0]])
    assert_no_leak(engine)
    expected_tokens = [tokens_of(d)[0] for d in engine.generate(chosen, plain)]
    for prompt, deltas, config, expected in zip(
        chosen, results, asking, expected_tokens, strict=False
    ):
        tokens = tokens_of(deltas)[0]
        assert tokens == expected, "asking for logprobs changes no greedy token"
        entries = _entries(deltas)[0]
        assert all(len(e.top_logprobs) == config.logprobs for e in entries)
        assert all(e.token == engine.tokenizer.decode([e.token_id]) for e in entries)
        _assert_close(entries, tokens, _reference(hf_model, prompt, tokens))
    assert all(delta.logprobs is None for delta in results[-1])


def test_processed_logprobs_of_a_sampled_row(
    engine: LLMEngine, hf_model: Any, prompts: list[list[int]]
) -> None:
    prompt = prompts[1]
    temperature = 0.5
    config = GenerationConfig(
        max_new_tokens=NUM_NEW,
        ignore_eos=True,
        do_sample=True,
        temperature=temperature,
        seed=11,
        logprobs=3,
        logprobs_mode="processed",
    )
    raw_config = config.model_copy(update={"logprobs_mode": "raw"})
    processed, raw = engine.generate([prompt, prompt], [config, raw_config])
    assert_no_leak(engine)
    tokens = tokens_of(processed)[0]
    assert tokens == tokens_of(raw)[0], "same seed, same tokens, whatever the mode"
    reference = _reference(hf_model, prompt, tokens)
    logits = torch.log_softmax(reference, dim=-1)  # logits up to a per-row constant
    _assert_close(_entries(processed)[0], tokens, torch.log_softmax(logits / temperature, -1))
    _assert_close(_entries(raw)[0], tokens, reference)
    assert _entries(processed)[0][0].logprob != pytest.approx(_entries(raw)[0][0].logprob)


def _prompt_reference(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at each prompt position but the last, ``[P-1, V]``:
    row p scores prompt token p + 1."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def _prompt_entries(deltas) -> dict[int, list[TokenLogprob]]:
    """Each choice's prompt logprobs; they come once per choice, on its first delta."""
    out: dict[int, list[TokenLogprob]] = {}
    for delta in deltas:
        if delta.prompt_logprobs is not None:
            assert delta.index not in out, "a choice shows its prompt's logprobs once"
            out[delta.index] = delta.prompt_logprobs
    return out


@pytest.mark.parametrize("batch_max_tokens", [512, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(
    make_engine, hf_model: Any, prompts: list[list[int]], batch_max_tokens: int
) -> None:
    """Every prompt token after the first, scored from the raw logits, whether the prompt runs
    in one step or in chunks of 7 tokens (beside a request that does not score its prompt),
    and whether or not its prefix is cached already."""
    engine = make_engine(batch_max_tokens=batch_max_tokens, num_blocks=128)
    prompt = prompts[2]
    plain = GenerationConfig(max_new_tokens=2, ignore_eos=True)
    engine.generate([prompt], [plain])  # its blocks are in the prefix cache now
    asking = GenerationConfig(max_new_tokens=2, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    scored, other = engine.generate([prompt, prompts[0]], [asking, plain])
    assert_no_leak(engine)
    assert _prompt_entries(other) == {}
    entries = _prompt_entries(scored)[0]
    assert len(entries) == len(prompt) - 1
    reference = _prompt_reference(hf_model, prompt)
    _assert_close(entries, prompt[1:], reference)
    assert all(len(e.top_logprobs) == 3 for e in entries)
    assert tokens_of(scored)[0] == tokens_of(engine.generate([prompt], [plain])[0])[0]


def test_prompt_logprobs_for_every_sample_and_beam(
    engine: LLMEngine, hf_model: Any, prompts: list[list[int]]
) -> None:
    """n samples and beam-search results each open with the same prompt logprobs."""
    prompt = prompts[4]
    reference = _prompt_reference(hf_model, prompt)
    sampled = GenerationConfig(
        max_new_tokens=3, do_sample=True, seed=5, num_return_sequences=3, prompt_logprobs=0
    )
    beams = GenerationConfig(
        max_new_tokens=3, num_beams=2, num_return_sequences=2, prompt_logprobs=1
    )
    for deltas, num_choices in zip(
        engine.generate([prompt, prompt], [sampled, beams]), (3, 2), strict=True
    ):
        by_choice = _prompt_entries(deltas)
        assert sorted(by_choice) == list(range(num_choices))
        for entries in by_choice.values():
            _assert_close(entries, prompt[1:], reference)
    assert_no_leak(engine)
