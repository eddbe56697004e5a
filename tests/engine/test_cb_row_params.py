"""Row parameters are built once per sequence, and the cached ones still decode like transformers
(the repetition penalty follows the growing sequence, the min_new_tokens ban ends on time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.generation import GenerationConfig
from server.continuous_batching.decoding.row_params import RowParams
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import DEMO_QUESTION, engine_config

EOS = 2
PERIOD = 30  # "." in the default model's vocabulary


@pytest.fixture
def engine(default_model_path: Path, cb_runner: ModelRunner) -> LLMEngine:
    return LLMEngine(engine_config(default_model_path, num_blocks=64), runner=cb_runner)


@pytest.fixture
def num_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the RowParams the decoder builds."""
    count = [0]
    build = RowParams.from_generation_config

    def counting(*args: object, **kwargs: object) -> RowParams:
        count[0] += 1
        return build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(RowParams, "from_generation_config", counting)
    return count


def chat_ids(engine: LLMEngine, question: str = DEMO_QUESTION) -> list[int]:
    chat = [{"role": "user", "content": question}]
    prompt = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(prompt, add_special_tokens=False).input_ids


def test_one_build_per_sequence(engine: LLMEngine, num_builds: list[int]) -> None:
    prompt = chat_ids(engine)
    engine.generate([prompt], [GenerationConfig(max_new_tokens=6, ignore_eos=True)])
    assert num_builds[0] == 1
    samples = GenerationConfig(max_new_tokens=5, do_sample=True, num_return_sequences=3, seed=3)
    engine.generate([prompt], [samples])
    assert num_builds[0] == 1 + 1 + 3  # the prompt's row, then one per forked sample


@pytest.mark.parametrize(
    ("question", "stop_token_ids"),
    [
        # "The capital of France is Paris." with "." (30) banned for 7 tokens: a later "."
        # ends it, which needs the ban lifted on time.
        (DEMO_QUESTION, [PERIOD]),
        # The plain answer repeats itself after 8 tokens: the penalty must cover the tokens
        # generated since the row was built, not only the prompt.
        ("Count from one to twenty in words.", []),
    ],
)
def test_cached_rows_match_transformers(
    engine: LLMEngine,
    hf_model: Any,
    num_builds: list[int],
    question: str,
    stop_token_ids: list[int],
) -> None:
    prompt = chat_ids(engine, question)
    options = {"max_new_tokens": 24, "min_new_tokens": 7, "repetition_penalty": 1.3}
    config = GenerationConfig(**options, stop_token_ids=stop_token_ids)
    (deltas,) = engine.generate([prompt], [config])
    ours = [t for d in deltas for t in d.token_ids]
    inputs = torch.tensor([prompt])
    stop_ids = [EOS, *stop_token_ids]
    greedy = {"attention_mask": torch.ones_like(inputs), "do_sample": False}
    with torch.inference_mode():
        out = hf_model.generate(inputs, eos_token_id=stop_ids, **greedy, **options)
    theirs = out[0, len(prompt) :].tolist()
    ends = [i for i, t in enumerate(theirs) if t in stop_ids]
    if ends:  # generate pads after the stop; the engine ends at it
        theirs = theirs[: ends[0] + 1]
    assert ours == theirs and len(ours) > options["min_new_tokens"]
    assert num_builds[0] == 1
