"""GGUF weights kept quantised: the repacking into our layout is exact (equal to gguf's own
dequantiser bit for bit), and the fused ``quant_linear`` kernel, at every ISA level this CPU
runs (and its scalar loops), matches a float64 matmul of the dequantised weight; with int8
activations (the AVX2 kernel), a float64 matmul of the dequantised weight and the quantised x."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from server.continuous_batching.model import cpu_kernels
from server.continuous_batching.quantization.packed_gguf import (
    PACKABLE_TYPES,
    concat_rows,
    repack,
)
from server.continuous_batching.quantization.packed_linear import (
    ConcatLinear,
    PackedLinear,
    has_int8_layout,
    quantize_activations,
)
from tests.support.cpu_paths import kernel_levels
from tests.support.gguf_files import random_blocks

TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
IDS = [t.name for t in TYPES]


def _k_for(qtype: T, num_super: int) -> int:
    """A row length: K-quants need whole 256-weight super-blocks, the others blocks of 32
    (an odd count of them, so no vector-width multiple hides a tail bug)."""
    return 256 * num_super if qtype in (T.Q4_K, T.Q5_K, T.Q6_K) else 32 * (2 * num_super + 1)


@pytest.fixture(scope="module", params=kernel_levels())
def kernels(request):
    module = cpu_kernels.load(request.param)
    if module is None:
        why = f"the fused CPU kernels ({request.param}) could not be built (see the log)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return module


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_repack_is_exact(qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, 7, _k_for(qtype, 3), rng)
    weight = repack(raw, qtype)
    expected = dequantize(raw, qtype)
    assert weight.in_features == expected.shape[1] and weight.num_rows == 7
    assert np.array_equal(weight.dequantize().numpy(), expected)
    # Rows: permuting and stacking packed rows is exact too.
    order = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    assert np.array_equal(weight.select_rows(order).dequantize().numpy(), expected[order])
    both = concat_rows([weight, weight.select_rows(order)])
    assert np.array_equal(both.dequantize().numpy(), np.concatenate([expected, expected[order]]))
    assert weight.num_bytes <= 1.6 * raw.nbytes  # near the source (8-bit Q5_K codes: 1.6x)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_dequantize_rows_kernel_equals_the_reference(kernels, qtype) -> None:
    """An embedding lookup's rows (``PackedWeight.dequantize_rows``): the kernel's one pass
    equals ``select_rows().dequantize()`` bit for bit, plain and, where the build tiles the
    layout, tiled (4-, 5- and 6-bit tiles); bad rows are refused."""
    raw = random_blocks(qtype, 48, _k_for(qtype, 2), np.random.default_rng(int(qtype) + 7))
    weight = repack(raw, qtype)
    index = torch.tensor([47, 0, 16, 15, 3, 47, 31])  # across tiles of 16, repeated
    expected = torch.from_numpy(dequantize(raw, qtype))[index]
    layouts = [weight]
    if getattr(kernels, "has_lane_tiles", False) and weight.can_lane_tile:
        layouts.append(weight.lane_tiled(kernels))
        assert layouts[-1].is_lane_tiled
    for layout in layouts:
        got = layout.dequantize_rows(index, kernels)
        assert got.dtype == torch.float32 and torch.equal(got, expected), layout.bits
        assert torch.equal(layout.dequantize_rows(index, None), expected)  # the torch path
        assert layout.dequantize_rows(index[:0], kernels).shape == (0, weight.in_features)
        with pytest.raises(RuntimeError, match="out of range"):
            layout.dequantize_rows(torch.tensor([48]), kernels)


def test_other_types_are_refused() -> None:
    assert T.Q2_K not in PACKABLE_TYPES
    with pytest.raises(ValueError, match="no packed layout"):
        repack(np.zeros((1, 84), np.uint8), T.Q2_K)


def _reference(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.dequantize().double().T
    return out if bias is None else out + bias.double()


def _quant_linear(kernels, x: torch.Tensor, weight, bias: torch.Tensor, **flags: bool):
    """The kernel called directly (not through ``PackedLinear``, whose choices it tests)."""
    parts = (weight.codes, weight.bits, weight.group, weight.group_scale, weight.group_offset)
    return kernels.quant_linear(x, *parts, weight.super_scale, weight.super_offset, bias, **flags)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 9], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quant_linear_matches_float64(kernels, qtype, rows, dtype) -> None:
    # M=1 is decode; 3 a partial row tile; 9 two whole tiles and a tail. 21 columns cross the
    # 16-column work units; the scalar loops run the same call as the reference kernel.
    rng = np.random.default_rng(rows * 100 + int(qtype))
    weight = repack(random_blocks(qtype, 21, _k_for(qtype, 2), rng), qtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, weight.in_features, generator=gen).to(dtype)
    bias = torch.randn(21, generator=gen)
    expected = _reference(x, weight, bias)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    scale = expected.abs().max().item()
    for is_scalar in (False, True):
        got = _quant_linear(kernels, x, weight, bias, is_scalar=is_scalar)
        assert got.dtype == dtype and got.shape == (rows, 21)
        assert (got.double() - expected).abs().max().item() <= tolerance * scale, is_scalar


def test_packed_linear_kernel_matches_reference_path(kernels) -> None:
    rng = np.random.default_rng(5)
    q4k = repack(random_blocks(T.Q4_K, 24, 512, rng), T.Q4_K)
    q6k = repack(random_blocks(T.Q6_K, 8, 512, rng), T.Q6_K)
    x = torch.randn(5, 512)
    fast, plain = PackedLinear(q4k, None, kernels), PackedLinear(q4k, None, None)
    torch.testing.assert_close(fast(x), plain(x), atol=1e-4, rtol=1e-4)
    # Different layouts stay separate parts, concatenated.
    mixed = ConcatLinear([PackedLinear(q4k, None, kernels), PackedLinear(q6k, None, kernels)])
    expected = torch.cat([plain(x), PackedLinear(q6k, None, None)(x)], dim=-1)
    torch.testing.assert_close(mixed(x), expected, atol=1e-4, rtol=1e-4)
    residual = torch.randn(5, 32)
    torch.testing.assert_close(mixed.add_to(residual, x), residual + expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 9], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_activations_match_the_quantised_x_in_float64(kernels, qtype, rows, dtype) -> None:
    # 21 columns: the decode kernel's groups of 4 and the batch kernel's pairs, with a tail.
    rng = np.random.default_rng(rows * 10 + int(qtype))
    weight = repack(random_blocks(qtype, 21, _k_for(qtype, 2), rng), qtype)
    assert has_int8_layout(weight)  # every packed type has a layout the int8 kernel takes
    # K-quants: x is quantised per 256-weight super-block (qgemm_super.h), others per group.
    is_k_quant = qtype in (T.Q4_K, T.Q5_K, T.Q6_K)
    assert weight.activation_group == (256 if is_k_quant else weight.group)
    gen = torch.Generator().manual_seed(rows + 7)
    x = torch.randn(rows, weight.in_features, generator=gen).to(dtype)
    x[0, : weight.activation_group] = 0.0  # an all-zero group: scale 0, no division by zero
    bias = torch.randn(21, generator=gen)
    if not kernels.has_int8_activations:  # the generic build: refused, by name
        with pytest.raises(RuntimeError, match="int8 activations need a build with AVX2"):
            _quant_linear(kernels, x, weight, bias, is_int8_activations=True)
        return
    got = _quant_linear(kernels, x, weight, bias, is_int8_activations=True)
    x_used = quantize_activations(x, weight.activation_group)
    expected = _reference(x_used, weight, bias)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    scale = expected.abs().max().item()
    assert got.dtype == dtype and got.shape == (rows, 21)
    assert (got.double() - expected).abs().max().item() <= tolerance * scale
    # The quantised x is close to x: int8 activations change the product a little.
    exact = _reference(x, weight, bias)
    assert 0 < (expected - exact).abs().max().item() <= 0.03 * scale


def test_packed_linear_int8_kernel_matches_its_reference_path(kernels) -> None:
    rng = np.random.default_rng(6)
    q6k = repack(random_blocks(T.Q6_K, 12, 512, rng), T.Q6_K)
    x = torch.randn(3, 512)
    fast = PackedLinear(q6k, None, kernels, is_int8_activations=True)
    plain = PackedLinear(q6k, None, None, is_int8_activations=True)
    assert plain.is_int8 and fast.is_int8 == kernels.has_int8_activations
    expected = plain(x) if fast.is_int8 else PackedLinear(q6k, None, None)(x)
    torch.testing.assert_close(fast(x), expected, atol=1e-4, rtol=1e-4)


K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def _takes_vnni(kernels, qtype, rows: int) -> bool:
    """The AVX512-VNNI builds' integer GEMM (``qgemm_vnni.h``) takes batches of the K-quants
    (Q6_K's groups of 16 from more rows than the others' groups of 32)."""
    least = kernels.vnni_min_rows_g16 if qtype == T.Q6_K else kernels.vnni_min_rows
    return qtype in K_QUANTS and 0 < least <= rows


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [8, 13, 16, 17, 33, 100], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vnni_gemm_equals_the_integer_kernels(kernels, qtype, rows, dtype) -> None:
    """Batches through the VNNI GEMM (blocks of 8 rows below 16, of 16 from 16; one block, two,
    three, and tails): the same integer sums as the dot-product kernels, run here on 4 rows at
    a time (never the GEMM), and the float64 reference of x quantised per super-block. 23
    columns: five tiles of 4 and a short one."""
    rng = np.random.default_rng(rows + 100 * int(qtype))
    weight = repack(random_blocks(qtype, 23, _k_for(qtype, 3), rng), qtype)
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, weight.in_features, generator=gen)).to(dtype)
    x[1, :256] = 0.0  # an all-zero super-block
    bias = torch.randn(23, generator=gen)
    got = _quant_linear(kernels, x, weight, bias, is_int8_activations=True)
    expected = _reference(quantize_activations(x, weight.activation_group), weight, bias)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    scale = expected.abs().max().item()
    assert got.dtype == dtype and got.shape == (rows, 23)
    assert (got.double() - expected).abs().max().item() <= tolerance * scale
    dots = torch.cat(
        [
            _quant_linear(kernels, x[i : i + 4], weight, bias, is_int8_activations=True)
            for i in range(0, rows, 4)
        ]
    )
    assert (got.double() - dots.double()).abs().max().item() <= tolerance * scale
    if kernels.__name__.endswith("avx512_bf16"):  # every AVX512-BF16 CPU has VNNI, its build too
        assert _takes_vnni(kernels, qtype, 40) and not _takes_vnni(kernels, qtype, 7)


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("rows", [31, 40, 64], ids=lambda m: f"m{m}")
def test_int8_mode_prefill_on_bf16_builds_multiplies_bf16_weights(kernels, qtype, rows) -> None:
    """The int8 mode's prefill (``qgemm_panels.h``): on AVX512-BF16 builds, 32 or more bf16
    rows multiply the weight dequantised to bf16 (exact bf16 products, float32 sums), except
    the K-quants, which the VNNI GEMM takes in integers; fewer rows, and builds without
    AVX512-BF16, quantise x as the integer kernels do. 64 rows: four blocks of 16 rows, taken
    as two tiles of two."""
    assert kernels.has_int8_activations
    rng = np.random.default_rng(rows + int(qtype))
    weight = repack(random_blocks(qtype, 21, _k_for(qtype, 2), rng), qtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, weight.in_features, generator=gen).bfloat16()
    bias = torch.randn(21, generator=gen)
    got = _quant_linear(kernels, x, weight, bias, is_int8_activations=True)
    is_panel = (
        kernels.has_quant_panels
        and rows >= kernels.quant_panel_min_rows
        and not _takes_vnni(kernels, qtype, rows)
    )
    if is_panel:
        w_bf16 = weight.dequantize().bfloat16().double()
        expected = x.double() @ w_bf16.T + bias.double()
    else:
        expected = _reference(quantize_activations(x, weight.activation_group), weight, bias)
    scale = expected.abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 21)
    assert (got.double() - expected).abs().max().item() <= 8e-3 * scale
    # The two products differ by more than that bound: the test tells which one ran.
    other = (
        _reference(quantize_activations(x, weight.activation_group), weight, bias)
        if is_panel
        else x.double() @ weight.dequantize().bfloat16().double().T + bias.double()
    )
    assert (other - expected).abs().max().item() > 0
