"""AWQ int4 checkpoints (AutoAWQ's ``gemm`` layout) loaded and kept packed on the CPU.

The test writes its own AWQ checkpoint: the GPTQ tests' min-max quantiser, then AWQ's packing
done here with the explicit nibble order (numpy, no code shared with the loader's unpacking).
Checked: every dequantised weight (the loader's reference and its packed layout) equals the
quantiser's value exactly (g32, g128); the engine's greedy tokens on packed kernels, at every
kernel level this machine has, equal transformers' on the dequantised float32 weights; and
unsupported variants are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from harness.gptq_writer import LINEARS, TOKENIZER_FILES, Quantized, rtn_quantize
from server.continuous_batching.engine_config import ModelLoadingConfig
from server.continuous_batching.model.weights import load_model
from server.continuous_batching.quantization import GPTQFormatError, dequantize_gptq
from server.continuous_batching.quantization.awq import AWQConfig, awq_to_gptq, dequantize_awq
from server.continuous_batching.quantization.checkpoint_formats import read_quant_checkpoint
from server.continuous_batching.quantization.gptq_packed import pack_gptq
from server.continuous_batching.quantization.packed_linear import ConcatLinear, PackedLinear
from tests.engine.test_gptq_packed import _greedy
from tests.support.cpu_paths import kernel_levels

#: Nibble k (lowest bits first) of an AWQ int32 holds output column ORDER[k] of its eight.
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> int32 [rows, cols / 8], AutoAWQ's interleaved order."""
    arr = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, 8)
    packed = np.zeros(arr.shape[:2], dtype=np.uint32)
    for nibble, column in enumerate(ORDER):
        packed |= arr[:, :, column] << np.uint32(4 * nibble)
    return torch.from_numpy(packed.view(np.int32))


def awq_layer(q: Quantized) -> dict[str, torch.Tensor]:
    return {"qweight": awq_pack(q.codes), "qzeros": awq_pack(q.zeros), "scales": q.scales}


def awq_settings(**changes: object) -> dict[str, object]:
    base = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64}
    return {**base, "zero_point": True, "modules_to_not_convert": None, **changes}


def write_awq(folder: Path, model_path: Path, group_size: int) -> dict[str, torch.Tensor]:
    """Quantise the default model's linears into an AWQ folder; the reference state dict."""
    tensors, reference = {}, {}
    for name, weight in load_file(str(model_path / "model.safetensors")).items():
        prefix = name.rpartition(".")[0]
        if prefix.rpartition(".")[2] not in LINEARS:
            tensors[name] = weight.half()
            reference[name] = tensors[name].float()
            continue
        q = rtn_quantize(weight, group_size, torch.arange(weight.shape[1]))
        tensors.update({f"{prefix}.{k}": v for k, v in awq_layer(q).items()})
        reference[name] = q.dequantize()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_path / "config.json").read_text())
    config.update(dtype="float16", quantization_config=awq_settings(group_size=group_size))
    (folder / "config.json").write_text(json.dumps(config))
    for file in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copy(model_path / file, folder / file)
    return reference


@pytest.mark.parametrize("group_size", [32, 128])
def test_dequantised_weights_are_awqs_values(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    q = rtn_quantize(torch.randn(48, 256, generator=gen), group_size, torch.arange(256))
    tensors = awq_layer(q)
    config = AWQConfig.from_dict(awq_settings(group_size=group_size))
    expected = q.dequantize()
    assert torch.equal(dequantize_awq(tensors, config), expected)
    converted = awq_to_gptq(tensors)
    assert torch.equal(dequantize_gptq(converted, config.as_gptq()), expected)
    packed, order = pack_gptq(converted, config.as_gptq())
    assert order is None and torch.equal(packed.dequantize(), expected)


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path):
    folder = tmp_path_factory.mktemp("awq")
    return folder, write_awq(folder, default_model_path, 64)


def test_loaded_layers_equal_the_reference(awq_checkpoint) -> None:
    folder, reference = awq_checkpoint
    model, _ = load_model(
        read_config(folder, gptq_cpu_kernel="torch")  # QuantLinear exposes its weight
    )
    names = ("q_proj", "k_proj", "v_proj")
    qkv = torch.cat([reference[f"model.layers.0.self_attn.{n}.weight"] for n in names]).t()
    assert torch.equal(model.layers[0].qkv.weight(), qkv)
    assert model.weight_format.startswith("awq int4 QuantLinear")


def read_config(folder: Path, **options: object) -> ModelLoadingConfig:
    return ModelLoadingConfig.model_validate(
        {"model_name_or_path": str(folder), "torch_dtype": "float32", **options}
    )


@pytest.fixture(scope="module")
def expected_tokens(awq_checkpoint, default_model_path: Path) -> list[int]:
    """transformers' greedy tokens on the dequantised float32 weights (``_greedy``'s prompt)."""
    folder, reference = awq_checkpoint
    hf = HFLlama(LlamaConfig.from_pretrained(default_model_path)).eval()
    hf.load_state_dict(reference, strict=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    eos = tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("level", kernel_levels())
def test_engine_tokens_equal_the_dequantised_model(awq_checkpoint, expected_tokens, level) -> None:
    folder, _ = awq_checkpoint
    tokens, engine = _greedy(folder, gptq_cpu_kernel="packed", cpu_isa=level)
    model = engine.runner.model
    assert model.weight_format.startswith(f"awq int4 packed ({level}")
    assert isinstance(model.layers[0].qkv, (PackedLinear, ConcatLinear))
    assert tokens == expected_tokens


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": "gemv"}, "version 'gemv'"),
        ({"version": "marlin"}, "version 'marlin'"),
        ({"bits": 8}, "bits=8"),
        ({"zero_point": False}, "zero_point false"),
    ],
)
def test_unsupported_variants_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": awq_settings(**change)})
    )
    with pytest.raises(GPTQFormatError, match=message):
        read_quant_checkpoint(tmp_path)
