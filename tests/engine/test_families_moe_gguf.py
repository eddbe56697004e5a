"""GGUF files of the MoE families written by llama.cpp's own converter (``harness.llama_cpp``):
Mixtral (written as architecture "llama" with experts, q/k rows permuted) and Qwen3-MoE
("qwen3moe", q/k norms) read as their Hugging Face folders and give transformers' greedy
tokens through the engine. llama.cpp's converter cannot write a Qwen3-MoE with dense layers
(``mlp_only_layers``), so every layer here is MoE; its graphs renormalise the top-k weights,
so the Qwen3-MoE checkpoint sets ``norm_topk_prob``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, PretrainedConfig, PreTrainedModel, Qwen3MoeConfig

from harness import llama_cpp
from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.model.weights import read_arch_config
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config
from tests.support.tiny_checkpoints import VOCAB_SIZE, write_tiny_checkpoint

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2683, 253, 29412, 28, 9637, 30, 17, 901]]
NUM_NEW_TOKENS = 8

CONFIGS: dict[str, PretrainedConfig] = {
    "mixtral": MixtralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3_moe": Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def hf_greedy(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (float32, no eos stop)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def converted(request, tmp_path_factory: pytest.TempPathFactory, default_model_path: Path):
    """A tiny random MoE saved as HF, then converted to an f32 GGUF by llama.cpp."""
    folder = tmp_path_factory.mktemp(request.param)
    model = write_tiny_checkpoint(CONFIGS[request.param], folder, default_model_path)
    gguf = llama_cpp.convert_hf_to_gguf(folder, folder / "tiny-f32.gguf", outtype="f32")
    return folder, model, gguf


def test_llama_cpp_moe_gguf_gives_transformers_tokens(converted) -> None:
    folder, model, gguf = converted
    config = engine_config(gguf, num_blocks=64, num_blocks_cpu=0)
    runner = ModelRunner(config)
    # The metadata reads as the folder's config (up to float32 rounding of the eps).
    expected_arch = read_arch_config(folder)
    assert runner.arch.family == expected_arch.family
    assert runner.arch.num_experts == expected_arch.num_experts == 4
    assert runner.arch.moe_intermediate_size == expected_arch.moe_intermediate_size
    assert runner.arch.tie_word_embeddings == expected_arch.tie_word_embeddings
    engine = LLMEngine(config, runner=runner)
    configs = [GenerationConfig(max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)] * len(PROMPTS)
    results = engine.generate(PROMPTS, configs)
    ours = [[t for d in deltas for t in d.token_ids] for deltas in results]
    assert ours == [hf_greedy(model, p) for p in PROMPTS]
