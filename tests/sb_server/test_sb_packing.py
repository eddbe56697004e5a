"""The static-batching server's packaging rules, run with the real default model and ``generate``.

The model loads once per session (``sb_model`` in conftest.py); each test starts its own batcher
(so it can choose the packaging limits) on top of it. Prompts are short and ``max_new_tokens``
small: CPU time.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.waiting import async_wait_until
from protocol.generation import FinishReason, GenerationConfig
from server.common.backend import SequenceRequest
from server.static_batching.backend import StaticBatchingBackend
from server.static_batching.config import SBServerConfig
from server.static_batching.worker import LoadedModel
from utils.errors import APIError

pytestmark = pytest.mark.slow

EOS_TOKEN_ID = 2


def make_config(
    model_path: Path, max_workload: int = 16, interval: float = 0.05, max_queue_size: int = 256
) -> SBServerConfig:
    """A server config over ``model_path`` with the given packaging limits."""
    return SBServerConfig.model_validate(
        {
            "batcher_config": {
                "package_max_workload": max_workload,
                "packaging_interval_seconds": interval,
                "max_queue_size": max_queue_size,
            },
            "worker_config": {"model_name_or_path": str(model_path)},
        }
    )


# ``sb_model`` (the default model, loaded once per session) and ``default_model_path`` come
# from conftest.py.


@pytest.fixture
async def make_backend(sb_model: LoadedModel, default_model_path: Path) -> Any:
    """Build started backends over the shared model; all are shut down after the test."""
    backends: list[StaticBatchingBackend] = []

    async def build(**limits: Any) -> StaticBatchingBackend:
        config = make_config(default_model_path, **limits)
        backend = StaticBatchingBackend(config, loaded=sb_model)
        await backend.start()
        backends.append(backend)
        return backend

    yield build
    for backend in backends:
        await backend.shutdown()


def chat_ids(model: LoadedModel, question: str) -> list[int]:
    """The prompt tokens of one user question rendered with the chat template."""
    messages = [{"role": "user", "content": question}]
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(model.tokenizer(text, add_special_tokens=False).input_ids)


@dataclass
class Answer:
    """Everything one request got back, per choice."""

    texts: dict[int, str] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, FinishReason | None] = field(default_factory=dict)
    num_batches: int = 0


async def ask(backend: StaticBatchingBackend, request: SequenceRequest) -> Answer:
    """Stream ``request`` to the end and accumulate its choices."""
    answer = Answer()
    async for deltas in backend.stream(request):
        answer.num_batches += 1
        for delta in deltas:
            answer.texts[delta.index] = answer.texts.get(delta.index, "") + delta.text
            answer.num_tokens[delta.index] = answer.num_tokens.get(delta.index, 0)
            answer.num_tokens[delta.index] += delta.num_new_tokens
            answer.finish_reasons[delta.index] = delta.finish_reason
    return answer


def request(model: LoadedModel, request_id: str, question: str, **config: Any) -> SequenceRequest:
    """A chat request with a small default ``max_new_tokens``."""
    config.setdefault("max_new_tokens", 4)
    return SequenceRequest(request_id, chat_ids(model, question), GenerationConfig(**config))


def packages(backend: StaticBatchingBackend) -> list[set[str]]:
    """The request ids of each package run so far, in order."""
    return [set(record.request_ids) for record in backend.package_records]


async def test_compatible_requests_share_a_package_and_others_do_not(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=0.3)
    reqs = [
        # Greedy with different per-row limits, stops and sampling knobs (ignored by greedy).
        request(sb_model, "g1", "Hi", max_new_tokens=3),
        request(sb_model, "g2", "Name a color", stop=["\n"], temperature=0.3),
        request(sb_model, "g3", "Say yes", ignore_eos=True, min_new_tokens=2),
        request(sb_model, "s1", "Hi", do_sample=True, temperature=0.7),
        request(sb_model, "s2", "Hello", do_sample=True, temperature=0.7, num_return_sequences=2),
        request(sb_model, "s3", "Hello", do_sample=True, temperature=0.9),
        request(sb_model, "b1", "Hi", num_beams=2),
    ]
    answers = await asyncio.gather(*(ask(backend, r) for r in reqs))
    assert all(set(a.finish_reasons.values()) <= {"stop", "length"} for a in answers)
    assert len(answers[4].texts) == 2
    assert sorted(packages(backend), key=sorted) == sorted(
        [{"g1", "g2", "g3"}, {"s1", "s2"}, {"s3"}, {"b1"}], key=sorted
    )


async def test_overflow_beyond_max_workload_splits_into_packages(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(max_workload=4, interval=0.3)
    reqs = [
        request(sb_model, f"r{i}", "Hi", do_sample=True, num_return_sequences=2, max_new_tokens=2)
        for i in range(3)
    ] + [request(sb_model, "big", "Hi", do_sample=True, num_return_sequences=4, max_new_tokens=2)]
    answers = await asyncio.gather(*(ask(backend, r) for r in reqs))
    assert [len(a.texts) for a in answers] == [2, 2, 2, 4]
    records = backend.package_records
    assert all(record.num_workload_beams <= 4 for record in records)
    # FCFS: r0+r1 fill the first package; r2 is then oldest, "big" cannot join it.
    assert packages(backend) == [{"r0", "r1"}, {"r2"}, {"big"}]


async def test_twenty_concurrent_mixed_requests_all_finish(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(max_workload=8)
    kinds: list[dict[str, Any]] = [
        {},
        {"stop": [" "]},
        {"do_sample": True, "temperature": 0.8},
        {"do_sample": True, "temperature": 0.8, "num_return_sequences": 2},
        {"num_beams": 2},
        {"do_sample": True, "seed": 7},
        {"repetition_penalty": 1.2, "max_new_tokens": 2},
    ]
    reqs = [
        request(
            sb_model, f"m{i}", f"Count to {i}", **{"max_new_tokens": 3, **kinds[i % len(kinds)]}
        )
        for i in range(20)
    ]
    answers = await asyncio.wait_for(asyncio.gather(*(ask(backend, r) for r in reqs)), timeout=120)
    for req, answer in zip(reqs, answers, strict=True):
        assert sorted(answer.texts) == list(range(req.config.num_return_sequences))
        assert all(reason in ("stop", "length") for reason in answer.finish_reasons.values())
        assert all(1 <= n <= req.config.max_new_tokens for n in answer.num_tokens.values())
    seen = [rid for record in backend.package_records for rid in record.request_ids]
    assert sorted(seen) == sorted(r.request_id for r in reqs)  # each ran exactly once
    assert backend.load_report().num_waiting == 0


async def test_each_answer_goes_to_its_own_caller(make_backend: Any, sb_model: LoadedModel) -> None:
    questions = ["What is the capital of France?", "Hi", "Name three fruits.", "What is 2+2?"]
    backend = await make_backend(interval=0.3)
    reqs = [request(sb_model, f"q{i}", q, max_new_tokens=8) for i, q in enumerate(questions)]
    answers = await asyncio.gather(*(ask(backend, r) for r in reqs))
    assert packages(backend) == [{"q0", "q1", "q2", "q3"}]  # one left-padded batch
    for req, answer in zip(reqs, answers, strict=True):
        # The same prompt alone through plain transformers generate (no padding at all).
        with torch.inference_mode():
            output = sb_model.model.generate(
                torch.tensor([req.prompt_token_ids]),
                attention_mask=torch.ones((1, req.num_prompt_tokens), dtype=torch.long),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=EOS_TOKEN_ID,
                pad_token_id=EOS_TOKEN_ID,
            )
        new_ids = output[0, req.num_prompt_tokens :].tolist()
        if EOS_TOKEN_ID in new_ids:  # usage counts the EOS token; the text does not show it
            new_ids = new_ids[: new_ids.index(EOS_TOKEN_ID) + 1]
        expected = sb_model.tokenizer.decode(new_ids, skip_special_tokens=True)
        assert answer.texts[0] == expected
        assert answer.num_tokens[0] == len(new_ids)
        assert answer.finish_reasons[0] == ("stop" if new_ids[-1] == EOS_TOKEN_ID else "length")
    assert answers[0].texts[0] == "The capital of France is Paris."


async def test_seeded_sampling_is_reproducible_whatever_else_is_queued(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=0.2)
    seeded = {"do_sample": True, "temperature": 1.0, "seed": 1234, "max_new_tokens": 6}
    alone = await ask(backend, request(sb_model, "alone", "Tell me a story", **seeded))
    crowd = [
        request(sb_model, f"c{i}", "Tell me a story", do_sample=True, temperature=1.0)
        for i in range(3)
    ]
    again, *_ = await asyncio.gather(
        ask(backend, request(sb_model, "again", "Tell me a story", **seeded)),
        *(ask(backend, r) for r in crowd),
    )
    assert again.texts == alone.texts
    assert {"again"} in packages(backend)  # it ran alone


async def test_stop_strings_and_max_new_tokens_apply_per_row(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=0.3)
    question = "What is the capital of France?"  # greedy: "The capital of France is Paris."
    reqs = [
        request(sb_model, "stop", question, max_new_tokens=12, stop=[" of"]),
        request(sb_model, "short", question, max_new_tokens=2),
        request(sb_model, "stop-id", question, max_new_tokens=12, stop_token_ids=[3575]),
        request(sb_model, "eos", question, max_new_tokens=12),
        request(sb_model, "min", question, max_new_tokens=12, min_new_tokens=10),
    ]
    stop, short, stop_id, eos, min_ = await asyncio.gather(*(ask(backend, r) for r in reqs))
    assert packages(backend) == [{"stop", "short", "stop-id", "eos", "min"}]
    assert (stop.texts[0], stop.finish_reasons[0]) == ("The capital", "stop")
    assert stop.num_tokens[0] == 3  # "The", " capital", " of" (cut from the text)
    assert (short.texts[0], short.finish_reasons[0], short.num_tokens[0]) == (
        "The capital",
        "length",
        2,
    )
    # Token 3575 is " capital": the stop token ends the row and is not shown.
    assert (stop_id.texts[0], stop_id.finish_reasons[0], stop_id.num_tokens[0]) == (
        "The",
        "stop",
        2,
    )
    assert (eos.texts[0], eos.finish_reasons[0]) == ("The capital of France is Paris.", "stop")
    assert eos.num_tokens[0] == 8  # seven text tokens and the EOS token
    assert eos.num_batches > 1  # greedy rows stream as they go
    # EOS is kept away until min_new_tokens, so the row goes past "Paris.".
    assert min_.texts[0].startswith(eos.texts[0]) and min_.num_tokens[0] >= 10


async def test_beam_search_answers_once_and_cuts_stop_strings(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend()
    config = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 10, "stop": ["Paris"]}
    answer = await ask(
        backend, request(sb_model, "beam", "What is the capital of France?", **config)
    )
    assert answer.num_batches == 1 and sorted(answer.texts) == [0, 1]
    assert all("Paris" not in text for text in answer.texts.values())
    assert all(reason in ("stop", "length") for reason in answer.finish_reasons.values())


async def test_oversized_request_is_refused_with_400(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(max_workload=4)
    too_big = request(sb_model, "big", "Hi", num_beams=5)
    with pytest.raises(APIError, match="package_max_workload is 4") as info:
        await ask(backend, too_big)
    assert info.value.status_code == 400
    assert "5 beams" in info.value.message and "package_max_workload is 4" in info.value.message
    assert backend.package_records == []


async def _until_queued(backend: StaticBatchingBackend) -> None:
    """Wait until ``backend`` holds a waiting request."""
    await async_wait_until(
        lambda: backend.load_report().num_waiting,
        10,
        interval=0.01,
        message="the request to be queued",
    )


async def test_full_queue_answers_503_with_retry_after(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=30, max_queue_size=1)
    waiting = asyncio.create_task(ask(backend, request(sb_model, "w", "Hi")))
    await _until_queued(backend)
    with pytest.raises(APIError, match=r"the queue is full \(1 requests waiting\)") as info:
        await ask(backend, request(sb_model, "x", "Hi"))
    assert info.value.status_code == 503 and "Retry-After" in info.value.headers
    await backend.shutdown()  # the waiting request ends with "abort"
    assert (await waiting).finish_reasons == {0: "abort"}


async def test_abort_of_a_waiting_request_removes_it(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=30)
    task = asyncio.create_task(ask(backend, request(sb_model, "gone", "Hi")))
    await _until_queued(backend)
    task.cancel("the client went away")  # the stream is closed
    with pytest.raises(asyncio.CancelledError, match="the client went away"):
        await task
    assert backend.load_report().num_waiting == 0
    assert backend.package_records == []


async def test_abort_of_a_running_request_stops_its_rows(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=0)
    num_generated: list[int] = []
    generate_returned = threading.Event()
    real_generate = sb_model.model.generate

    def watched_generate(*args: Any, **kwargs: Any) -> Any:
        output = real_generate(*args, **kwargs)
        num_generated.append(output.shape[1] - kwargs["input_ids"].shape[1])
        generate_returned.set()
        return output

    sb_model.model.generate = watched_generate
    try:
        long = request(sb_model, "long", "Write a story.", max_new_tokens=400, ignore_eos=True)
        stream = backend.stream(long)
        await anext(stream)  # generation is under way
        await stream.aclose()  # the client went away
        assert await asyncio.to_thread(generate_returned.wait, 120)
    finally:
        del sb_model.model.generate
    assert num_generated[0] < 50  # stopped at the next step, not after 400 tokens
    assert backend.load_report().num_running == 0


async def test_error_in_generate_fails_only_that_package(
    make_backend: Any, sb_model: LoadedModel
) -> None:
    backend = await make_backend(interval=0)

    def broken_generate(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    sb_model.model.generate = broken_generate  # an instance attribute shadows the method
    try:
        with pytest.raises(APIError, match="RuntimeError: boom") as info:
            await ask(backend, request(sb_model, "bad", "Hi"))
    finally:
        del sb_model.model.generate
    assert info.value.status_code == 500 and "boom" in info.value.message
    answer = await ask(backend, request(sb_model, "good", "Hi"))
    assert answer.finish_reasons[0] in ("stop", "length")
