"""The Triton GPTQ int4 matmul (``quantization.triton_int4``) against the dequantised weight.

Layers are quantised and packed by the tests' own GPTQ writer (``harness.gptq_writer``), read by
``QuantLinear.from_gptq`` into its portable layout, and multiplied by the kernel (Triton's CPU
interpreter without a GPU); the reference is ``x @ QuantLinear.weight()``, the dequantised
weight, in float32.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton numpy)")

from harness.gptq_writer import pack_layer, rtn_quantize  # noqa: E402
from server.continuous_batching.quantization import (  # noqa: E402
    GPTQConfig,
    QuantLinear,
    triton_int4,  # noqa: E402
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _layer(
    in_features: int, out: int, group_size: int, act_order: bool, dtype: torch.dtype, seed: int
) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn((out, in_features), generator=gen) * 0.05
    order = torch.randperm(in_features, generator=gen) if act_order else torch.arange(in_features)
    tensors = pack_layer(rtn_quantize(weight, group_size, order), "gptq")
    config = GPTQConfig(
        bits=4, group_size=group_size, desc_act=act_order, sym=False, checkpoint_format="gptq"
    )
    return QuantLinear.from_gptq(tensors, config, dtype, DEVICE)


def _kernel(layer: QuantLinear, x: torch.Tensor, **options: object) -> torch.Tensor:
    return triton_int4.int4_matmul(
        layer._input(x), layer.packed, layer.zeros, layer.scales, layer.row_group_index(), **options
    )


@pytest.mark.parametrize(
    ("in_features", "out", "group_size", "act_order", "rows"),
    [
        (256, 96, 32, False, 1),  # g32, a decode GEMV
        (512, 80, 128, False, 5),  # g128, N not a multiple of the tile
        (256, 64, 32, True, 3),  # act-order: rows gathered by perm, groups sorted
        (96, 48, 64, True, 20),  # a last group of 32 rows: non-uniform groups (row_groups)
    ],
)
def test_int4_matmul_matches_the_dequantised_weight(
    in_features: int, out: int, group_size: int, act_order: bool, rows: int
) -> None:
    layer = _layer(in_features, out, group_size, act_order, torch.float32, seed=in_features)
    assert (layer.perm is not None) == act_order
    if in_features % group_size:
        assert layer.row_groups is not None
    x = torch.randn((rows, in_features), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = _kernel(layer, x)
    want = layer._input(x) @ layer.weight()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_int4_matmul_16_bit_native_dots() -> None:
    """The GPU's 16-bit path (the tile dequantised in x's dtype, tensor-core dots), float16
    in the interpreter (its bf16 tl.dot is wrong)."""
    layer = _layer(256, 64, 32, True, torch.float16, seed=7)
    x = torch.randn((4, 256), generator=torch.Generator().manual_seed(2)).to(torch.float16)
    got = _kernel(layer, x.to(DEVICE), native_dot=True)
    want = layer._input(x.to(DEVICE)).float() @ layer.weight().float()
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_quant_linear_runs_the_kernel_where_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wired into QuantLinear (call and the fused residual add) when the kernel is available;
    the CPU int4 kernel and the portable path are untouched otherwise."""
    layer = _layer(128, 32, 32, False, torch.float32, seed=3)
    x = torch.randn((2, 128), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    residual = torch.randn((2, 32), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = x @ layer.weight()
    if DEVICE.type == "cpu":
        assert not layer.uses_triton
        monkeypatch.setattr(triton_int4, "is_available", lambda device: True)
    calls: list[int] = []
    matmul = triton_int4.int4_matmul
    monkeypatch.setattr(
        triton_int4, "int4_matmul", lambda *a, **k: calls.append(1) or matmul(*a, **k)
    )
    assert layer.uses_triton
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.add_to(residual, x), residual + want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2
