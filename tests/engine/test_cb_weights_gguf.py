"""GGUF loading: the package's SmolLM2 GGUF read directly must give the model that the
safetensors folder (converted from the same file by transformers) gives, and the engine must
run from the GGUF alone (tokenizer included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from protocol.generation import GenerationConfig
from server.continuous_batching.cb_server_config import load_cb_server_config
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig, gguf_path
from server.continuous_batching.model import (
    LlamaForCausalLM,
    build_attention_metadata,
    kv_cache_shape,
)
from server.continuous_batching.model.weights import load_model, read_arch_config
from server.continuous_batching.model.weights_gguf import hf_name, unpermute_rope_rows
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import engine_config
from tools.prepare_model import find_gguf

CPU = torch.device("cpu")
BLOCK = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small dragon"]


@pytest.fixture(scope="module")
def gguf_runner() -> ModelRunner:
    """The engine's runner over the GGUF file (float32) loaded the plain way (every tensor
    dequantised at load: the path compared with the converted folder), small KV pool."""
    config = engine_config(Path(find_gguf()), num_blocks=64, num_blocks_cpu=0)
    config.model_loading_config.gguf_dequantize_at_load = True
    return ModelRunner(config)


@pytest.fixture(scope="module")
def packed_runner() -> ModelRunner:
    """The same file served as by default on a CPU: its Q4_1/Q8_0 weights kept quantised
    (packed, where the fused kernels run; else the same plain path)."""
    return ModelRunner(engine_config(Path(find_gguf()), num_blocks=64, num_blocks_cpu=0))


def last_logits(model: LlamaForCausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill every prompt in one forward (blocks 1.. in order); last-token logits."""
    lens, tables, nxt = [len(p) for p in prompts], [], 1
    for n in lens:
        tables.append(list(range(nxt, nxt + -(-n // BLOCK))))
        nxt += len(tables[-1])
    meta = build_attention_metadata(lens, lens, tables, BLOCK, CPU)
    shape = kv_cache_shape(model.config, nxt, BLOCK)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    hidden = model(ids, positions, caches, meta)
    return model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1])


def test_config_from_metadata_matches_converted_folder(gguf_runner, default_model_path) -> None:
    assert gguf_runner.arch == read_arch_config(default_model_path)
    assert gguf_runner.max_model_len == 8192
    assert gguf_runner.loading_config.gguf_path == find_gguf()


def test_logits_match_converted_safetensors(gguf_runner, default_model_path) -> None:
    converted, _ = load_model(engine_config(default_model_path).model_loading_config)
    # Same dequantiser (gguf.quants) on both sides: the weights agree bit for bit.
    ours = dict(gguf_runner.model.named_parameters())
    for name, param in converted.named_parameters():
        assert torch.equal(ours[name], param), name
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    expected = last_logits(converted, prompts)
    torch.testing.assert_close(last_logits(gguf_runner.model, prompts), expected, atol=1e-5, rtol=0)


def test_engine_from_gguf_alone_answers_paris(packed_runner) -> None:
    # No tokenizer folder: the tokenizer (and chat template) come from the GGUF file.
    engine = LLMEngine(engine_config(Path(find_gguf()), num_blocks=64), runner=packed_runner)
    assert engine.eos_token_ids == [2]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    (deltas,) = engine.generate([ids], [GenerationConfig(max_new_tokens=16)])
    assert "Paris" in "".join(d.text for d in deltas)


def test_unpermute_matches_transformers_and_inverts_llama_cpp() -> None:
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf permutation of q/k rows, per head.
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_rope_rows(permuted, heads), weight)
    theirs = LlamaTensorProcessor()._reverse_permute_weights(permuted.numpy(), heads, heads)
    assert torch.equal(unpermute_rope_rows(permuted, heads), torch.from_numpy(theirs))
    bias = torch.randn(heads * head_dim)
    permuted_bias = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    assert torch.equal(unpermute_rope_rows(permuted_bias, heads), bias)


def test_names_paths_and_configs(tmp_path: Path) -> None:
    assert hf_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight" and hf_name("rope_freqs.weight") is None
    assert gguf_path("models/x") is None and gguf_path("a/b.GGUF") == Path("a/b.GGUF")
    assert gguf_path(str(tmp_path), "m.gguf") == tmp_path / "m.gguf"
    assert gguf_path(str(tmp_path), "/abs/m.gguf") == Path("/abs/m.gguf")
    with pytest.raises(ValueError, match="gptq needs a GPTQ folder"):
        EngineConfig.model_validate(
            {"model_loading_config": {"model_name_or_path": "m.gguf", "quantize_method": "gptq"}}
        )
    # The CB server's config file accepts a GGUF file where a folder would have config.json.
    config_file = tmp_path / "cb.json"
    loading = {"model_name_or_path": str(find_gguf()), "torch_dtype": "float32"}
    config_file.write_text(json.dumps({"model_loading_config": loading}))
    assert load_cb_server_config(config_file).model_loading_config.model_name_or_path
