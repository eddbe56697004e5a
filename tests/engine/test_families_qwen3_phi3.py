"""Qwen3 and Phi-3 through the engine, token for token against transformers (float32).

Tiny random checkpoints built with transformers' own classes: Qwen3 with tied embeddings and
with untied ones saved as shards (model.safetensors.index.json); Phi-3 plain, and Phi-3 with
LongRoPE and Phi-4-mini's partial rotary factor (0.75), whose prompts stay below
``original_max_position_embeddings`` and whose answers run past it, so both the short and the
long factors are used. At every CPU ISA level this machine runs (forced; "generic" is the
torch reference ops), greedy tokens must equal transformers': batched with the other prompts,
and after swap preemptions. A generation_config.json with two EOS ids ends generation at
either; the checkpoints' chat templates render through our renderer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.engine.conftest import assert_no_leak, tokens_of
from tests.support.cpu_paths import runnable_levels
from tests.support.default_model import engine_config
from tests.support.tiny_families import (
    PHI3_TEMPLATE,
    QWEN3_TEMPLATE,
    TINY_SHAPES,
    hf_greedy_tokens,
    save_checkpoint,
)
from utils.chat_template import render_conversation

NUM_NEW = 24
TEXTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "def fibonacci(n):",
    "Rain is",
    "In 1969, humans walked on the moon and",
    "List three colors:",
]
#: LongRoPE's pretraining length in the tiny Phi-3: prompts (< 16 tokens) end below it.
LONGROPE_ORIGINAL = 16


@dataclass
class Family:
    """A tiny checkpoint (a BUILDERS name) on disk and transformers' greedy tokens for TEXTS."""

    name: str
    path: Path
    prompts: list[list[int]]
    expected: list[list[int]]


def qwen3(tied: bool) -> Qwen3ForCausalLM:
    config = Qwen3Config(**TINY_SHAPES, head_dim=32, tie_word_embeddings=tied)
    return Qwen3ForCausalLM(config)


def phi3(longrope: bool) -> Phi3ForCausalLM:
    extra: dict[str, object] = {}
    if longrope:
        rotary_dim = int(0.75 * TINY_SHAPES["hidden_size"] // TINY_SHAPES["num_attention_heads"])
        extra = {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": LONGROPE_ORIGINAL,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_dim // 2)],
                "long_factor": [2.0 + 0.5 * i for i in range(rotary_dim // 2)],
            },
        }
    config = Phi3Config(**TINY_SHAPES, sliding_window=None, pad_token_id=0, **extra)
    return Phi3ForCausalLM(config)


BUILDERS = {
    "qwen3_tied": (lambda: qwen3(tied=True), QWEN3_TEMPLATE, None),
    "qwen3_untied_sharded": (lambda: qwen3(tied=False), QWEN3_TEMPLATE, "4MB"),
    "phi3": (lambda: phi3(longrope=False), PHI3_TEMPLATE, None),
    "phi3_longrope_partial": (lambda: phi3(longrope=True), PHI3_TEMPLATE, None),
}


def build_family(name: str, folder: Path, default_model_path: Path) -> Family:
    """Checkpoint ``name`` of BUILDERS saved in ``folder``, with transformers' tokens."""
    build, template, shard_size = BUILDERS[name]
    torch.manual_seed(0)
    hf = build().eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    assert all(len(p) < LONGROPE_ORIGINAL for p in prompts)
    expected = [hf_greedy_tokens(hf, p, NUM_NEW) for p in prompts]
    # The second EOS id is a token the first answer reaches (not earlier): it must stop there.
    stop_at = next(i for i, t in enumerate(expected[0]) if i >= 3 and t not in expected[0][:i])
    eos = [int(tokenizer.eos_token_id), expected[0][stop_at]]
    save_checkpoint(hf, folder, default_model_path, template, eos, shard_size)
    return Family(name, folder, prompts, expected)


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tmp_path_factory, default_model_path: Path) -> Family:
    return build_family(request.param, tmp_path_factory.mktemp(request.param), default_model_path)


def level_config(path: Path, level: str, **cache: object) -> EngineConfig:
    config = engine_config(path, **{"num_blocks": 128, "num_blocks_cpu": 64, **cache})
    config.model_loading_config.cpu_isa = level
    return config


@pytest.fixture(scope="module", params=runnable_levels())
def runner(request, family: Family) -> ModelRunner:
    return ModelRunner(level_config(family.path, request.param))


def engine_of(family: Family, runner: ModelRunner, **cache: object) -> LLMEngine:
    """A fresh engine over the loaded runner, at its level, with cache overrides."""
    return LLMEngine(
        level_config(family.path, runner.loading_config.cpu_isa, **cache), runner=runner
    )


def test_the_checkpoint_is_what_the_test_says(family: Family, runner: ModelRunner) -> None:
    model = runner.model
    name = family.name
    assert model.config.family == name.split("_")[0]
    assert (model.lm_head is model.embed_tokens) == ("_tied" in name)
    assert (family.path / "model.safetensors.index.json").is_file() == ("sharded" in name)
    if "partial" in name:
        assert model.config.rotary_dim == 12 and model.rotary.cos.shape[1] == 12


def test_greedy_batched_matches_transformers(family: Family, runner: ModelRunner) -> None:
    engine = engine_of(family, runner)
    configs = [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(family.prompts)
    results = engine.generate(family.prompts, configs)
    assert [tokens_of(r)[0] for r in results] == family.expected
    assert_no_leak(engine)


def test_greedy_after_swap_matches_transformers(family: Family, runner: ModelRunner) -> None:
    engine = engine_of(family, runner, num_blocks=8, watermark=0.0, enable_prefix_caching=False)
    configs = [GenerationConfig(max_new_tokens=NUM_NEW, ignore_eos=True)] * len(family.prompts)
    results = engine.generate(family.prompts, configs)
    assert engine.stats.num_swap_preemptions > 0
    assert [tokens_of(r)[0] for r in results] == family.expected
    assert_no_leak(engine)


def test_either_eos_id_ends_generation(family: Family, runner: ModelRunner) -> None:
    engine = engine_of(family, runner)
    assert len(engine.eos_token_ids) == 2
    stop_token = engine.eos_token_ids[1]
    (deltas,) = engine.generate([family.prompts[0]], [GenerationConfig(max_new_tokens=NUM_NEW)])
    expected = family.expected[0]
    assert tokens_of(deltas)[0] == expected[: expected.index(stop_token) + 1]
    assert deltas[-1].finish_reason == "stop"


def test_chat_template_renders(family: Family, runner: ModelRunner) -> None:
    engine = engine_of(family, runner)
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsaying hello\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = render_conversation(engine.tokenizer, chat)
    if family.name.startswith("qwen3"):
        assert text == (
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        )
        no_think = render_conversation(
            engine.tokenizer, chat[:1], template_kwargs={"enable_thinking": False}
        )
        assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:
        assert text.startswith("<|user|>\nHi<|end|>\n<|assistant|>\n<think>")
        assert text.endswith("<|user|>\nBye<|end|>\n<|assistant|>\n")
