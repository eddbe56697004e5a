"""The engine at every CPU ISA level this machine can run, forced through ``cpu_isa`` (the
config key behind ``LLM_SUITE_CPU_ISA``): kernels compiled for that level alone and oneDNN's
bf16 packing off below AVX-512, so an AVX-512 machine checks the AVX2 path and the torch ops
too. Each level must give transformers' float32 greedy and beam tokens exactly in float32, and
stay within the documented bfloat16 tolerance (README, "CPU paths"): at least 12 of the 16
prompts give float32 transformers' 12 greedy tokens exactly (measured 13-14 at each level).
OpenAI's knobs (``logit_bias``, presence and frequency penalties) give, at each level, the
greedy tokens of transformers with a reference processor written from their definitions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.model import cpu_isa
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.engine.conftest import NUM_NEW, assert_no_leak, hf_generate, tokens_of
from tests.support.cpu_paths import runnable_levels
from tests.support.default_model import engine_config
from tests.support.logit_knobs_reference import reference_greedy

#: Documented bfloat16 tolerance: prompts (of 16) whose greedy tokens equal float32's.
MIN_BF16_IDENTICAL = 12


def level_config(path: Path, level: str, dtype: str) -> EngineConfig:
    config = engine_config(path, num_blocks=256, num_blocks_cpu=64)
    config.model_loading_config.cpu_isa = level
    config.model_loading_config.torch_dtype = dtype
    return config


@pytest.fixture(scope="module", params=runnable_levels())
def level(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def runners(level: str, default_model_path: Path) -> Iterator[dict[str, ModelRunner]]:
    """float32 and bfloat16 runners of one level (one level's pair alive at a time)."""
    made = {
        dtype: ModelRunner(level_config(default_model_path, level, dtype))
        for dtype in ("float32", "bfloat16")
    }
    yield made
    made.clear()


@pytest.fixture
def engine(level: str, default_model_path: Path, runners: dict[str, ModelRunner]):
    """A fresh engine of this level over its loaded runner of a dtype."""

    def build(dtype: str) -> LLMEngine:
        return LLMEngine(level_config(default_model_path, level, dtype), runner=runners[dtype])

    return build


def test_the_level_is_the_one_asked_for(level, runners) -> None:
    for dtype, runner in runners.items():
        path = runner.compute_path
        assert path.isa == level and path.device == "cpu"
        expected_ops = "torch" if level == "generic" else f"fused CPU kernels ({level})"
        assert path.decoder_ops == expected_ops, dtype
        assert path.summary.startswith(f"decoder ops: {cpu_isa.KERNEL_WORDS[level]}, ")
        linear = runner.model.layers[0].qkv
        if dtype == "bfloat16":
            # The kernels' own matmul at every kernel level; no oneDNN bf16 below AVX-512.
            assert linear.packing == ("none" if level == "generic" else "kernels")


def test_float32_greedy_and_beams_match_transformers(
    level, engine, prompts, hf_greedy, hf_model
) -> None:
    eng = engine("float32")
    beams = GenerationConfig(max_new_tokens=10, num_beams=3, num_return_sequences=2)
    greedy = GenerationConfig(max_new_tokens=NUM_NEW)
    results = eng.generate(prompts + [prompts[3]], [greedy] * len(prompts) + [beams])
    for deltas, expected in zip(results, hf_greedy, strict=False):
        assert tokens_of(deltas)[0] == expected
    expected_beams = hf_generate(
        hf_model, prompts[3], max_new_tokens=10, num_beams=3, num_return_sequences=2
    )
    got = tokens_of(results[-1])
    for index, hf_tokens in enumerate(expected_beams):
        mine = got[index]
        assert mine == hf_tokens[: len(mine)] and all(t == 2 for t in hf_tokens[len(mine) :])
    assert_no_leak(eng)


def test_bfloat16_within_the_documented_tolerance(level, engine, prompts, hf_greedy) -> None:
    eng = engine("bfloat16")
    results = eng.generate(prompts, [GenerationConfig(max_new_tokens=NUM_NEW)] * len(prompts))
    identical = sum(
        tokens_of(deltas)[0] == expected
        for deltas, expected in zip(results, hf_greedy, strict=True)
    )
    assert identical >= MIN_BF16_IDENTICAL, f"{identical} of {len(prompts)} at {level}"
    assert_no_leak(eng)


#: (prompt index, knobs) for the knob test: a chat row biased, a plain row penalised, one with
#: every additive knob; a row without knobs rides along.
KNOB_ROWS: list[tuple[int, dict[str, object]]] = [
    (0, {"logit_bias": {7042: -5.0, 504: 1.5}}),
    (12, {"frequency_penalty": 0.8, "presence_penalty": 0.3}),
    (3, {"frequency_penalty": 1.2, "presence_penalty": -0.4, "logit_bias": {30: 2.0}}),
    (5, {}),
]


@pytest.fixture(scope="module")
def reference_knob_tokens(hf_model, prompts) -> list[list[int]]:
    """transformers' greedy tokens for KNOB_ROWS (computed once for every level)."""
    return [reference_greedy(hf_model, prompts[i], NUM_NEW, **knobs) for i, knobs in KNOB_ROWS]


def test_float32_knobs_match_the_reference(level, engine, prompts, reference_knob_tokens) -> None:
    eng = engine("float32")
    configs = [
        GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True, **knobs)  # type: ignore[arg-type]
        for _, knobs in KNOB_ROWS
    ]
    results = eng.generate([prompts[i] for i, _ in KNOB_ROWS], configs)
    for deltas, expected in zip(results, reference_knob_tokens, strict=True):
        assert tokens_of(deltas)[0] == expected, level
    assert_no_leak(eng)
