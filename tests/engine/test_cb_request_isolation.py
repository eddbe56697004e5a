"""A request whose preparation or sampling raises fails alone: its blocks are freed, its
stream ends with an error, and its batch mates finish with the tokens they would have had."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest
from server.continuous_batching.decoding import decoder
from server.continuous_batching.decoding.decoder import RequestOutput
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from server.continuous_batching.sampling import sampler
from tests.support.default_model import engine_config

#: The poison request is told apart by this (otherwise harmless) temperature.
POISON_TEMPERATURE = 0.123
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture
def engine(default_model_path: Path, cb_runner: ModelRunner) -> LLMEngine:
    return LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)


def _run(engine: LLMEngine, configs: dict[str, GenerationConfig]) -> dict[str, list[RequestOutput]]:
    """Every request's outputs, all of them stepped together."""
    for i, (request_id, config) in enumerate(configs.items()):
        prompt = engine.tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        engine.add_request(SequenceRequest(request_id, prompt, config))
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in configs}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            outputs[output.request_id].append(output)
    assert not engine.has_unfinished_requests()
    return outputs


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(delta.text for output in outputs for delta in output.deltas)


def _mates() -> dict[str, GenerationConfig]:
    greedy = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    sampled = GenerationConfig(max_new_tokens=8, do_sample=True, seed=7, ignore_eos=True)
    beams = GenerationConfig(max_new_tokens=6, num_beams=2, ignore_eos=True)
    return {"greedy": greedy, "sampled": sampled, "beams": beams}


def _poisoned_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sample = sampler.sample

    def sample(logits, rows: list[RowParams]):  # type: ignore[no-untyped-def]
        if any(row.temperature == POISON_TEMPERATURE for row in rows):
            raise IndexError("index 10**30 is out of bounds (injected)")
        return real_sample(logits, rows)

    monkeypatch.setattr(sampler, "sample", sample)


@pytest.mark.parametrize("where", ["sampling", "preparation"])
def test_a_failing_request_fails_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    expected = {request_id: _text(out) for request_id, out in _run(engine, _mates()).items()}
    if where == "sampling":
        _poisoned_sample(monkeypatch)
    else:
        real_row = decoder.row_params_for

        def row(group, seq):  # type: ignore[no-untyped-def]
            if group.config.temperature == POISON_TEMPERATURE:
                raise ValueError("bad row parameters (injected)")
            return real_row(group, seq)

        monkeypatch.setattr(decoder, "row_params_for", row)
    poison = GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=POISON_TEMPERATURE, num_return_sequences=2
    )
    outputs = _run(engine, {**_mates(), "poison": poison})
    failed = outputs["poison"][-1]
    assert failed.is_finished and failed.error is not None and "injected" in failed.error
    assert [delta.finish_reason for delta in failed.deltas] == ["abort", "abort"]
    for request_id, text in expected.items():
        assert _text(outputs[request_id]) == text, request_id
        assert outputs[request_id][-1].error is None
    # Nothing leaked: every block is back in the pool.
    assert engine.block_manager.device.is_all_free()
