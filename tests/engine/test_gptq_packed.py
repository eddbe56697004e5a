"""GPTQ int4 layers repacked into the packed kernels' layout (``gptq_cpu_kernel: packed``):
every weight equal to GPTQ's dequantised value bit for bit (g32, g128, a short last group,
act-order, v1 and v2 zero points), the kernels at every ISA level equal to the reference
path, and the engine's greedy tokens equal to those of the dequantised checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.gptq_writer import pack_layer, rtn_quantize, write_checkpoint
from protocol.generation import GenerationConfig
from server.continuous_batching.engine import LLMEngine
from server.continuous_batching.engine_config import EngineConfig
from server.continuous_batching.model import cpu_kernels
from server.continuous_batching.quantization import GPTQConfig
from server.continuous_batching.quantization.gptq_packed import (
    GPTQPackError,
    GPTQPacking,
    pack_gptq,
)
from server.continuous_batching.quantization.packed_linear import ConcatLinear, PackedLinear
from tests.support.cpu_paths import kernel_levels

CASES = {  # name: (in_features, group_size, act_order, checkpoint format)
    "g32": (256, 32, False, "gptq"),
    "g128_v2": (256, 128, False, "gptq_v2"),
    "g128_short_last_group": (192, 128, False, "gptq"),
    "g32_act_order": (256, 32, True, "gptq"),
    "g64_act_order_v2": (256, 64, True, "gptq_v2"),
}


def _layer(case: str, seed: int = 0, num_out: int = 40):
    in_features, group_size, act_order, fmt = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, in_features, generator=gen)
    order = torch.randperm(in_features, generator=gen) if act_order else torch.arange(in_features)
    q = rtn_quantize(weight, group_size, order)
    config = GPTQConfig(bits=4, group_size=group_size, desc_act=act_order, sym=False,
                        checkpoint_format=fmt)  # fmt: skip
    return q, pack_layer(q, fmt), config


@pytest.mark.parametrize("case", CASES)
def test_every_weight_is_gptqs_value(case: str) -> None:
    q, tensors, config = _layer(case)
    packed, order = pack_gptq(tensors, config)
    assert (order is not None) == CASES[case][2]
    expected = q.dequantize()  # [out, in], channels in their own order
    if order is not None:
        expected = expected[:, order]
    assert torch.equal(packed.dequantize(), expected)
    assert packed.num_bytes <= expected.numel() * 6.5 / 8  # g32: 6.5 bits a weight, g128: 5


def test_groups_under_32_channels_are_refused() -> None:
    q = rtn_quantize(torch.randn(8, 64), 16, torch.arange(64))
    config = GPTQConfig(bits=4, group_size=16, desc_act=False, sym=False, checkpoint_format="gptq")
    with pytest.raises(GPTQPackError, match="whole runs of 32"):
        pack_gptq(pack_layer(q, "gptq"), config)


@pytest.mark.parametrize("is_int8", [False, True])
@pytest.mark.parametrize("level", kernel_levels())
@pytest.mark.parametrize("case", ["g128_v2", "g128_short_last_group", "g32_act_order"])
def test_kernels_equal_the_reference(case: str, level: str, is_int8: bool) -> None:
    kernels = cpu_kernels.load(level)
    parts = [_layer(case, seed)[1] for seed in (1, 2)]
    config = _layer(case)[2]
    for part in parts:
        part["bias"] = torch.randn(part["scales"].shape[1])
    fused = GPTQPacking(kernels, is_int8).linear(parts, config)
    reference = GPTQPacking(None, is_int8).linear(parts, config)  # type: ignore[arg-type]
    # Act-order parts quantised apart have their own input orders: one linear each.
    expected_type = ConcatLinear if CASES[case][2] else PackedLinear
    assert isinstance(fused, expected_type) and isinstance(reference, expected_type)
    # int8 activations: g128 in whole groups is summed in integers per 128-weight super-block
    # (qgemm_super.h), the others per packed group of 32.
    first = fused.parts[0] if isinstance(fused, ConcatLinear) else fused
    assert first.weight.activation_group == (128 if case == "g128_v2" else 32)
    # 9 and 20 rows: batches the AVX512-VNNI builds multiply as one integer GEMM (qgemm_vnni.h),
    # in blocks of 8 and of 16 rows.
    for rows in (3, 13, 20):
        x = torch.randn(rows, CASES[case][0], generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(fused(x), reference(x), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def act_order_checkpoint(tmp_path_factory: pytest.TempPathFactory, default_model_path: Path):
    """The default model quantised with act-order, group 32 (GPTQ v1)."""
    folder = tmp_path_factory.mktemp("gptq_packed")
    source = load_file(str(default_model_path / "model.safetensors"))
    write_checkpoint(folder, default_model_path, source, fmt="gptq", group_size=32, desc_act=True)
    return folder


def _greedy(folder: Path, **loading: object) -> tuple[list[int], LLMEngine]:
    config = EngineConfig.model_validate(
        {
            "model_loading_config": {
                "model_name_or_path": str(folder),
                "torch_dtype": "float32",
                **loading,
            },
            "cache_config": {"num_blocks": 64, "num_blocks_cpu": 0},
        }
    )
    engine = LLMEngine(config)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    (deltas,) = engine.generate([ids], [GenerationConfig(max_new_tokens=10)])
    return [t for d in deltas for t in d.token_ids], engine


def test_engine_tokens_equal_the_dequantised_checkpoints(act_order_checkpoint: Path) -> None:
    dense, _ = _greedy(act_order_checkpoint, gptq_dequantize_at_load=True)
    tokens, engine = _greedy(act_order_checkpoint, gptq_cpu_kernel="packed")
    model = engine.runner.model
    assert model.weight_format.startswith("gptq int4 packed (")
    qkv = model.layers[0].qkv
    assert isinstance(qkv, (PackedLinear, ConcatLinear))
    assert tokens == dense


def test_auto_leaves_to_torch_only_what_its_int4_kernel_takes() -> None:
    from server.continuous_batching.quantization.quant_linear import cpu_kernel_available

    kernels = cpu_kernels.load(kernel_levels()[-1])
    even = _layer("g32", num_out=48)[1:]  # outputs a multiple of 16, as torch's kernel needs
    short = _layer("g128_short_last_group", num_out=48)[1:]
    bf16 = GPTQPacking(kernels, is_auto=True, dtype=torch.bfloat16)
    has_torch_kernel = cpu_kernel_available(torch.device("cpu"), torch.bfloat16)
    assert bf16.takes([even[0]], even[1]) is not has_torch_kernel
    assert bf16.takes([short[0]], short[1])  # a short last group: torch would dequantise
    assert GPTQPacking(kernels, is_auto=True).takes([even[0]], even[1])  # float32
    assert GPTQPacking(kernels).takes([even[0]], even[1])  # packed, always
