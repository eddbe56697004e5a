"""OpenAI's sampling knobs on the static-batching server (transformers ``generate`` with the
worker's processors): per row in one package, equal to transformers with a reference processor
written from the definitions; ``min_p`` after the temperature; accepted over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from harness.servers import ServerThread
from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest
from server.static_batching.worker import LoadedModel
from tests.sb_server.test_sb_packing import ask, chat_ids, make_backend, packages
from tests.support.default_model import DEMO_QUESTION, MODEL_ID
from tests.support.logit_knobs_reference import reference_greedy

pytestmark = pytest.mark.slow

__all__ = ["make_backend"]  # the fixture, imported for this module's tests

PARIS = 7042  # " Paris" in the default model's vocabulary
ONE = 33  # "1"


async def test_rows_with_different_knobs_share_a_package(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    """Greedy rows with a forcing bias, a ban, penalties and none, in one ``generate``: each
    gives transformers' tokens with the reference processor of its own knobs."""
    backend = await make_backend(interval=0.3)
    # Greedy goes on with " 1" ("Ġ", "1": tokens 216, 33) eight times in 16 tokens.
    prompt = list(sb_model.tokenizer("1 1 1 1 1 1").input_ids)
    knobs: dict[str, dict[str, Any]] = {
        "plain": {},
        "forced": {"logit_bias": {42: 100.0}},
        "banned": {"logit_bias": {ONE: -100.0}},
        "penalised": {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        "both": {"frequency_penalty": 0.7, "presence_penalty": -0.3, "logit_bias": {30: 2.0}},
    }
    num_new = 10
    requests = [
        SequenceRequest(
            name, prompt, GenerationConfig(max_new_tokens=num_new, ignore_eos=True, **options)
        )
        for name, options in knobs.items()
    ]
    answers = await asyncio.gather(*(ask(backend, r) for r in requests))
    assert packages(backend) == [set(knobs)]
    tokenizer = sb_model.tokenizer
    for (name, options), answer in zip(knobs.items(), answers, strict=True):
        expected = reference_greedy(sb_model.model, prompt, num_new, **options)
        assert answer.texts[0] == tokenizer.decode(expected, skip_special_tokens=True), name
    texts = {name: answer.texts[0] for name, answer in zip(knobs, answers, strict=True)}
    assert texts["forced"] == tokenizer.decode([42] * num_new)
    assert texts["plain"].count("1") == num_new // 2 and "1" not in texts["banned"]
    assert len(set(texts.values())) == len(texts), "every knob changed the answer"


async def test_min_p_of_one_after_the_temperature_leaves_the_greedy_token(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    """``min_p`` 1 keeps only the likeliest token, whatever the temperature: sampling with it
    is greedy decoding, which shows it runs after the temperature and in the chain at all."""
    backend = await make_backend()
    prompt = chat_ids(sb_model, "Write a haiku about the sea.")

    def config(**options: Any) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=10, ignore_eos=True, **options)

    greedy = await ask(backend, SequenceRequest("greedy", prompt, config()))
    hot = config(do_sample=True, temperature=1.8, min_p=1.0, top_k=40, top_p=0.95)
    sampled = await asyncio.gather(
        *(ask(backend, SequenceRequest(f"hot{i}", prompt, hot)) for i in range(2))
    )
    assert all(answer.texts == greedy.texts for answer in sampled)
    seeded = config(do_sample=True, temperature=1.3, min_p=0.1, seed=77)
    first = await ask(backend, SequenceRequest("seeded", prompt, seeded))
    again = await ask(backend, SequenceRequest("seeded-again", prompt, seeded))
    assert first.texts == again.texts


def test_http_accepts_the_knobs_and_refuses_bad_ones(sb_server: ServerThread) -> None:
    chat = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": DEMO_QUESTION}],
        "max_tokens": 6,
        "temperature": 0,
        "logit_bias": {str(PARIS): -100},
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
        "min_p": 0.05,
    }
    answer = httpx.post(f"{sb_server.url}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 200, answer.text
    assert "Paris" not in answer.json()["choices"][0]["message"]["content"]
    outside = httpx.post(
        f"{sb_server.url}/v1/chat/completions",
        json={**chat, "logit_bias": {"49157": 1}},
        timeout=60,
    )
    assert outside.status_code == 400
    assert outside.json()["error"]["param"] == "logit_bias"
    assert "49157 is outside the vocabulary" in outside.json()["error"]["message"]
