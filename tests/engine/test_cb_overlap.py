"""Text made one step late (``overlap_detokenization``, on by default with cuda): run here on the
CPU, it must give the same tokens, text and finish reasons as text made in its own step, for
greedy, stop strings, seeded samples and beams, and leak nothing when a request is aborted
with its text still pending."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.generation import GenerationConfig
from server.common.backend import SequenceRequest
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.engine.conftest import assert_no_leak, tokens_of
from tests.support.default_model import engine_config


@pytest.fixture
def make(default_model_path: Path, cb_runner: ModelRunner):
    def build(is_overlapping: bool) -> LLMEngine:
        config = engine_config(default_model_path)
        config.batcher_config.overlap_detokenization = is_overlapping
        return LLMEngine(config, runner=cb_runner)

    return build


def run(engine: LLMEngine, batch: list[list[int]], configs: list[GenerationConfig]):
    """Every request's deltas, and the rows the engine ran (sequences summed over steps)."""
    num_rows = 0
    execute = engine.runner.execute

    def counting(plan):
        nonlocal num_rows
        num_rows += len(plan.scheduled)
        return execute(plan)

    engine.runner.execute = counting  # type: ignore[method-assign]
    try:
        results = engine.generate(batch, configs)
    finally:
        del engine.runner.execute
    assert_no_leak(engine)
    return results, num_rows


def summary(deltas) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str | None]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for delta in deltas:
        texts[delta.index] = texts.get(delta.index, "") + delta.text
        if delta.finish_reason is not None:
            reasons[delta.index] = delta.finish_reason
    return texts, tokens_of(deltas), reasons


def test_defaults_follow_the_device(make, cb_runner: ModelRunner) -> None:
    assert cb_runner.device.type == "cpu"
    assert make(None).is_overlapping is False
    assert make(True).is_overlapping is True


def test_greedy_and_stop_strings_match(make, prompts, hf_greedy) -> None:
    batch = prompts[:4]
    greedy = GenerationConfig(max_new_tokens=16)
    plain, _ = run(make(False), batch, [greedy] * 4)
    # A stop string that ends request 1 in the middle of its answer.
    text = summary(plain[1])[0][0]
    start = len(text) // 2
    while text[start : start + 3].strip() == "" or text.find(text[start : start + 3]) != start:
        start += 1
    stop = text[start : start + 3]
    configs = [greedy, greedy.model_copy(update={"stop": [stop]}), greedy, greedy]

    want, want_rows = run(make(False), batch, configs)
    got, got_rows = run(make(True), batch, configs)
    for mine, theirs in zip(got, want, strict=True):
        assert summary(mine) == summary(theirs)
    assert tokens_of(got[0])[0] == hf_greedy[0][: len(tokens_of(got[0])[0])]
    texts, _, reasons = summary(got[1])
    assert texts[0] == text[:start] and reasons[0] == "stop"
    # Found a step late, the stop string cost exactly one row of forward, and nothing else.
    assert got_rows == want_rows + 1


def test_seeded_samples_and_beams_match(make, prompts) -> None:
    batch = prompts[:3]
    configs = [
        GenerationConfig(max_new_tokens=9, do_sample=True, temperature=0.8, seed=7),
        GenerationConfig(max_new_tokens=6, do_sample=True, num_return_sequences=3, seed=3),
        GenerationConfig(max_new_tokens=5, num_beams=3, num_return_sequences=2),
    ]
    want, want_rows = run(make(False), batch, configs)
    got, got_rows = run(make(True), batch, configs)
    for mine, theirs in zip(got, want, strict=True):
        assert summary(mine) == summary(theirs)
    assert got_rows == want_rows
    assert len(summary(got[1])[1]) == 3 and len(summary(got[2])[1]) == 2


def test_one_token_requests_finish(make, prompts) -> None:
    engine = make(True)
    (deltas,) = engine.generate([prompts[0]], [GenerationConfig(max_new_tokens=1)])
    assert [d.finish_reason for d in deltas] == ["length"] and deltas[0].text
    assert_no_leak(engine)


def test_abort_with_text_pending_frees_everything(make, prompts) -> None:
    engine = make(True)
    config = GenerationConfig(max_new_tokens=30)
    engine.add_request(SequenceRequest("a", prompts[0], config))
    engine.add_request(SequenceRequest("b", prompts[1], config))
    seen: dict[str, int] = {"a": 0, "b": 0}
    for _ in range(4):  # prefill, then decodes: "a" has text pending after each
        for output in engine.step():
            seen[output.request_id] += sum(d.num_new_tokens for d in output.deltas)
    assert engine._pending_text.groups
    closing = engine.abort("a")
    assert closing is not None and closing.is_finished
    assert [d.finish_reason for d in closing.deltas] == ["abort"]
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "b"  # "a"'s pending text never comes out
            seen["b"] += sum(d.num_new_tokens for d in output.deltas)
    assert seen["b"] == 30 and 0 < seen["a"] < 30
    assert_no_leak(engine)
