"""The engine's async front: streaming from its own thread, aborts that free blocks, refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harness.waiting import async_wait_until
from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest
from server.continuous_batching.async_engine import AsyncEngine
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config
from utils.errors import APIError

PROMPT = [1, 504, 3575, 282, 4649, 314]  # "<s>The capital of France is"-like ids


@pytest.fixture
async def backend(default_model_path: Path, cb_runner: ModelRunner):
    config = engine_config(default_model_path, num_blocks=64)
    front = AsyncEngine(LLMEngine(config, runner=cb_runner), model_id="test")
    await front.start()
    yield front
    await front.shutdown()


async def collect(backend: AsyncEngine, request: SequenceRequest) -> list[int]:
    tokens: list[int] = []
    async for deltas in backend.stream(request):
        for delta in deltas:
            tokens.extend(delta.token_ids)
    return tokens


async def test_concurrent_streams_match_offline(
    default_model_path: Path, cb_runner: ModelRunner
) -> None:
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    engine = LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)
    # Offline first: once started, only the engine loop may step the engine.
    offline = engine.generate([PROMPT], [config])[0]
    expected = [t for d in offline for t in d.token_ids]
    backend = AsyncEngine(engine, model_id="test")
    await backend.start()
    try:
        results = await asyncio.gather(
            *[collect(backend, SequenceRequest(f"r{i}", PROMPT, config)) for i in range(5)]
        )
        assert all(r == expected for r in results)
        assert backend.load_report().num_kv_blocks_free == 64
    finally:
        await backend.shutdown()


async def test_closing_the_stream_aborts_and_frees_blocks(backend: AsyncEngine) -> None:
    request = SequenceRequest("long", PROMPT, GenerationConfig(max_new_tokens=500, ignore_eos=True))
    stream = backend.stream(request)
    await anext(stream)  # first token arrived: the request holds blocks now
    assert backend.load_report().num_running == 1
    await stream.aclose()
    await async_wait_until(  # the engine thread applies the abort within a step
        backend.load_report,
        2,
        interval=0.01,
        until=lambda report: report.num_running == 0 and report.num_kv_blocks_free == 64,
        message="the abort to free the request's blocks",
    )


async def test_refusals_surface_as_api_errors(backend: AsyncEngine) -> None:
    too_many_beams = GenerationConfig(max_new_tokens=4, num_beams=64, num_return_sequences=1)
    with pytest.raises(
        APIError, match=r"needs up to \d+ KV-cache blocks but the cache has \d+"
    ) as never_fits:
        await collect(backend, SequenceRequest("beams", PROMPT, too_many_beams))
    assert never_fits.value.status_code == 400
    # A full queue answers 503 with Retry-After, while the rest are served.
    backend.engine.config.batcher_config.max_num_waiting = 4
    long = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    tasks = [
        asyncio.create_task(collect(backend, SequenceRequest(f"q{i}", PROMPT * 30, long)))
        for i in range(12)
    ]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [r for r in results if isinstance(r, APIError)]
    served = [r for r in results if isinstance(r, list)]
    assert refused and served
    assert all(r.status_code == 503 and "Retry-After" in r.headers for r in refused)
    assert all(len(r) == 64 for r in served)
