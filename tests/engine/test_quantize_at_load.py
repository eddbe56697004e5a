"""A dense checkpoint quantised at load (``quantize_method: int8 | int4``): llama.cpp's Q8_0 /
Q4_1 blocks repacked for the CPU kernels, exactly, and the kernels' greedy tokens equal to
those of the same model with every quantised weight dequantised (the no-kernels path)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from pydantic import ValidationError

from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.model.weights import WeightLoadError
from server.continuous_batching.model.weights_at_load import quantize_matrix, round_trip
from server.continuous_batching.quantization.packed_linear import PackedLinear
from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.cpu_paths import kernel_levels
from tests.support.tiny_checkpoints import TINY_FAMILIES, write_tiny_checkpoint

PROMPTS = [[1, 450, 7483, 310, 3444], [1, 306, 763, 29871], [1, 15043, 29892, 920, 526, 366]]


def _config(folder: Path, **loading: object) -> EngineConfig:
    return EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(folder),
                "torch_dtype": "float32",
                **loading,
            },
            "cache_config": {"num_blocks": 64, "block_size": 16},
        }
    )


def _greedy(config: EngineConfig) -> tuple[list[list[int]], ModelRunner]:
    runner = ModelRunner(config)
    engine = LLMEngine(config, runner=runner)
    results = engine.generate(PROMPTS, [GenerationConfig(max_new_tokens=12)] * len(PROMPTS))
    return [[t for d in deltas for t in d.token_ids] for deltas in results], runner


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1])
def test_the_packed_weight_is_llama_cpps_dequantised_value(qtype: T) -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)) * 0.3
    expected = dequantize(quantize(weight.numpy(), qtype), qtype)
    packed = quantize_matrix(weight, qtype)
    assert np.array_equal(packed.dequantize().numpy(), expected)
    assert torch.equal(round_trip(weight, qtype), torch.from_numpy(expected))
    assert packed.num_bytes < weight.numel() * 2  # under bf16's bytes


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # untied lm_head; tied + q/k/v bias
def tiny_folder(request, tmp_path_factory, default_model_path: Path) -> Path:
    folder = tmp_path_factory.mktemp(f"at_load_{request.param}")
    write_tiny_checkpoint(TINY_FAMILIES[request.param](), folder, default_model_path)
    return folder


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("level", kernel_levels())
def test_packed_kernels_give_the_dequantised_models_tokens(
    tiny_folder: Path, method: str, level: str
) -> None:
    reference, ref_runner = _greedy(_config(tiny_folder, quantize_method=method, cpu_kernels=False))
    assert "dequantised to float32" in ref_runner.model.weight_format
    dense, _ = _greedy(_config(tiny_folder))
    tokens, runner = _greedy(_config(tiny_folder, quantize_method=method, cpu_isa=level))
    model = runner.model
    assert f"{method} at load" in model.weight_format and "packed" in model.weight_format
    assert all(isinstance(layer.qkv, PackedLinear) for layer in model.layers)
    assert isinstance(model.lm_head_linear, PackedLinear)
    assert tokens == reference
    assert tokens != dense or method == "int8"  # int4 moves a random model's choices


def test_the_default_model_still_names_paris_in_int4(default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    config = _config(default_model_path, quantize_method="int4", torch_dtype="bfloat16")
    runner = ModelRunner(config)
    result = LLMEngine(config, runner=runner).generate([ids], [GenerationConfig(max_new_tokens=12)])
    assert "Paris" in "".join(d.text for d in result[0])
    assert runner.model.weight_format.startswith("int4 at load (Q4_1 packed int4")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_refused_where_it_cannot_apply(method: str, tmp_path: Path) -> None:
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValidationError, match=f"{method} quantises a dense checkpoint"):
        _config(gguf, quantize_method=method)
    with pytest.raises(ValidationError, match="runs on the CPU kernels; on cuda serve a GPTQ"):
        _config(tmp_path, quantize_method=method, device="cuda")


def test_a_gptq_folder_is_not_quantised_again(tmp_path: Path, default_model_path: Path) -> None:
    folder = tmp_path / "gptq"
    write_tiny_checkpoint(TINY_FAMILIES["llama"](), folder, default_model_path)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    config_file.write_text(json.dumps({**config, "quantization_config": gptq}))
    with pytest.raises(WeightLoadError, match="is a GPTQ checkpoint"):
        ModelRunner(_config(folder, quantize_method="int4"))
