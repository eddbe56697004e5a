"""The engine tests' shared prompts and transformers' answers (session fixtures: computed once
for every engine test module), and their helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Who wrote Hamlet?",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
    "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
]
PLAIN_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "In 1969, humans",
    "Rain is",
]
NUM_NEW = 12


@pytest.fixture
def make_engine(default_model_path: Path, cb_runner: ModelRunner):
    def build(batch_max_tokens: int = 512, **cache: object) -> LLMEngine:
        config = engine_config(default_model_path, **cache)
        config.batcher_config.batch_max_tokens = batch_max_tokens
        return LLMEngine(config, runner=cb_runner)

    return build


@pytest.fixture(scope="session")
def prompts(cb_runner: ModelRunner, default_model_path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path))
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    encoded = [tokenizer(c, add_special_tokens=False).input_ids for c in chats]
    return encoded + [tokenizer(p).input_ids for p in PLAIN_PROMPTS]


@pytest.fixture(scope="session")
def hf_model(default_model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_path), dtype=torch.float32).eval()


def hf_generate(hf_model, prompt: list[int], **kwargs: object) -> list[list[int]]:
    """transformers' own output tokens for one prompt (pad/EOS stripped for beams)."""
    inputs = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(
            inputs, attention_mask=torch.ones_like(inputs), do_sample=False, **kwargs
        )
    return [row[len(prompt) :].tolist() for row in out]


@pytest.fixture(scope="session")
def hf_greedy(hf_model, prompts: list[list[int]]) -> list[list[int]]:
    result = []
    for prompt in prompts:
        (tokens,) = hf_generate(hf_model, prompt, max_new_tokens=NUM_NEW)
        if 2 in tokens:  # generate pads after EOS; the engine stops at it
            tokens = tokens[: tokens.index(2) + 1]
        result.append(tokens)
    return result


def tokens_of(deltas) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for delta in deltas:
        out.setdefault(delta.index, []).extend(delta.token_ids)
    return out


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.device.num_free == bm.device.num_blocks
    assert not any(bm.device.ref_counts) and bm.cpu.is_all_free()
