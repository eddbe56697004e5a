"""The tiled layout of the AVX512-VNNI and AVX2 builds (``quantization.lane_tiles``,
``cpu_kernels/qgemm_lanes.h``, ``qgemm_lanes_avx2.h``): weight rows in the vector lanes, tiled
once at load.

At every kernel level this CPU can run: where the build has the tiled kernel, it is checked
against the float64 reference of the dequantised weight (x quantised per super-block, as the
integer kernels do) and against the plain layout's integer kernels; elsewhere ``PackedLinear``
must keep the plain layout."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from server.continuous_batching.quantization.lane_tiles import tile_rows, untile_rows
from server.continuous_batching.quantization.packed_gguf import repack
from server.continuous_batching.quantization.packed_linear import (
    PackedLinear,
    quantize_activations,
)
from tests.support.cpu_paths import built_kernels, kernel_levels
from tests.support.gguf_files import random_blocks

K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.fixture(scope="module", params=kernel_levels())
def kernels(request):
    return built_kernels(request.param)


def _weight(qtype: T, rows: int, num_super: int, seed: int):
    return repack(random_blocks(qtype, rows, 256 * num_super, np.random.default_rng(seed)), qtype)


def _call(kernels, x: torch.Tensor, weight, bias: torch.Tensor | None, **flags: bool):
    parts = (weight.codes, weight.bits, weight.group, weight.group_scale, weight.group_offset)
    return kernels.quant_linear(x, *parts, weight.super_scale, weight.super_offset, bias, **flags)


def test_scales_tile_and_untile() -> None:
    values = torch.arange(32 * 5, dtype=torch.int16).view(32, 5)
    tiled = tile_rows(values)
    assert tiled.shape == values.shape and not torch.equal(tiled, values)
    assert torch.equal(tiled[0], torch.tensor([0, 5, 10, 15, 20], dtype=torch.int16))
    assert torch.equal(untile_rows(tiled), values)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_tiling_is_exact_and_reversible(kernels, qtype) -> None:
    weight = _weight(qtype, 48, 2, int(qtype))
    if not kernels.has_lane_tiles:
        assert not hasattr(kernels, "lane_tile_codes")
        return
    tiled = weight.lane_tiled(kernels)
    assert tiled.is_lane_tiled and tiled.in_features == weight.in_features
    # The super-block scales (and offsets) as fp16: the file's d and dmin, exactly.
    supers = [t for t in (weight.super_scale, weight.super_offset) if t is not None]
    assert tiled.super_scale.dtype == torch.float16
    assert tiled.super_offset is None or tiled.super_offset.dtype == torch.float16
    fp16_saving = sum(t.numel() * 2 for t in supers)
    if qtype == T.Q4_K:  # 4-bit codes keep their bytes, reordered
        assert tiled.bits == 4 and tiled.num_bytes == weight.num_bytes - fp16_saving
        assert not torch.equal(tiled.codes, weight.codes)
    elif qtype == T.Q5_K:  # byte codes of 0..31 as 5 bits: 180 bytes per 256 weights
        assert tiled.bits == 5 and tiled.codes.shape == (48, 512 * 5 // 8)
        assert tiled.num_bytes == weight.num_bytes - 48 * 512 * 3 // 8 - fp16_saving
        assert tiled.num_bytes == 48 * 2 * 180
    else:  # Q6_K's byte codes plus 32 as 6 bits
        assert tiled.bits == 6 and tiled.codes.shape == (48, 512 * 3 // 4)
        assert tiled.num_bytes == weight.num_bytes - 48 * 512 // 4 - fp16_saving
    for plain, back in zip(weight.tensors(), tiled.untiled().tensors(), strict=True):
        assert (plain is None and back is None) or torch.equal(plain, back)
    assert torch.equal(tiled.dequantize(), weight.dequantize())
    index = torch.tensor([47, 0, 16, 15, 3, 47])  # across tiles, repeated
    picked = tiled.select_rows(index)
    assert torch.equal(picked.dequantize(), weight.select_rows(index).dequantize())
    with pytest.raises(ValueError, match="cannot be tiled"):
        _weight(qtype, 40, 1, 1).lane_tiled(kernels)  # 40 rows: not whole tiles


def test_byte_codes_beyond_six_bits_stay_untiled(kernels) -> None:
    """6-bit tiles hold Q6_K's codes plus 32; other byte codes keep the plain layout (and the
    tiler itself refuses them)."""
    if not kernels.has_lane_tiles:
        return
    weight = _weight(T.Q6_K, 16, 1, 9)
    codes = weight.codes.clone()
    codes[3, 7] = 40  # 72 once offset: no 6-bit code
    odd = replace(weight, codes=codes)
    assert odd.lane_tiled(kernels) is odd
    with pytest.raises(RuntimeError, match="0..63"):
        kernels.lane_tile_codes(codes, 8, 32)


def test_byte_codes_beyond_five_bits_take_six_bit_tiles(kernels) -> None:
    """Q5_K's codes (0..31) tile as 5 bits; one code past 31 in a weight of that layout makes
    it 6-bit tiles, with the same products; the 5-bit tiler refuses it."""
    if not kernels.has_lane_tiles:
        return
    weight = _weight(T.Q5_K, 16, 1, 10)
    codes = weight.codes.clone()
    codes[5, 100] = 40
    wide = replace(weight, codes=codes)
    tiled = wide.lane_tiled(kernels)
    assert weight.lane_tiled(kernels).bits == 5 and tiled.bits == 6
    assert torch.equal(tiled.dequantize(), wide.dequantize())
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    got = _call(kernels, x, tiled, None, is_int8_activations=True, is_tiled=True)
    x_used = quantize_activations(x, wide.activation_group).double()
    expected = x_used @ wide.dequantize().double().T
    assert (got.double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()
    with pytest.raises(RuntimeError, match="0..31"):
        kernels.lane_tile_codes(codes, 8, 0, 5)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 17, 40], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiled_kernel_matches_float64_and_the_plain_kernels(kernels, qtype, rows, dtype) -> None:
    """Passes of 8 rows over a tile (one, several, a tail; few rows alternate two sets of
    accumulators); 48 weight rows: three tiles, split over the threads."""
    if not kernels.has_lane_tiles:
        return
    weight = _weight(qtype, 48, 3, rows + 10 * int(qtype))
    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, weight.in_features, generator=gen)).to(dtype)
    x[0, :256] = 0.0  # an all-zero super-block: scale 0
    bias = torch.randn(48, generator=gen)
    tiled = weight.lane_tiled(kernels)
    got = _call(kernels, x, tiled, bias, is_int8_activations=True, is_tiled=True)
    x_used = quantize_activations(x, weight.activation_group).double()
    expected = x_used @ weight.dequantize().double().T + bias.double()
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    scale = expected.abs().max().item()
    assert got.dtype == dtype and got.shape == (rows, 48)
    assert (got.double() - expected).abs().max().item() <= tolerance * scale
    plain = _call(kernels, x, weight, bias, is_int8_activations=True)
    assert (got.double() - plain.double()).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_tiled_kernel_in_runs_of_tiles(kernels, qtype) -> None:
    """Rows of 8192 weights: tiles of 64 KB (Q4_K), 80 KB (Q5_K) or 96 KB (Q6_K), so each
    block of rows of x meets the tiles in runs of a few (qgemm_lanes.h's kLaneChunkBytes), the
    last run short; 19 rows of x: two whole passes and a tail in every run."""
    if not kernels.has_lane_tiles:
        return
    weight = _weight(qtype, 80, 32, 5 + int(qtype))
    x = torch.randn(19, weight.in_features, generator=torch.Generator().manual_seed(7))
    got = _call(
        kernels, x, weight.lane_tiled(kernels), None, is_int8_activations=True, is_tiled=True
    )
    x_used = quantize_activations(x, weight.activation_group).double()
    expected = x_used @ weight.dequantize().double().T
    assert (got.double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()


def test_super_scales_stay_float32_where_fp16_is_not_exact(kernels) -> None:
    """A super scale fp16 cannot hold (GPTQ's, computed at load) keeps float32 in the tiles,
    and the kernel reads either kind (one flag per weight)."""
    if not kernels.has_lane_tiles:
        return
    weight = _weight(T.Q4_K, 32, 2, 11)
    odd = replace(weight, super_scale=weight.super_scale * (1 + 2**-20))
    tiled = odd.lane_tiled(kernels)
    assert tiled.super_scale.dtype == tiled.super_offset.dtype == torch.float32
    x = torch.randn(3, odd.in_features, generator=torch.Generator().manual_seed(2))
    got = _call(kernels, x, tiled, None, is_int8_activations=True, is_tiled=True)
    expected = quantize_activations(x, odd.activation_group).double() @ odd.dequantize().double().T
    assert (got.double() - expected).abs().max().item() <= 2e-5 * expected.abs().max().item()
    with pytest.raises(RuntimeError, match="fp16 super scales"):
        plain_fp16 = replace(weight, super_scale=weight.super_scale.half())
        _call(
            kernels,
            x,
            replace(plain_fp16, super_offset=weight.super_offset.half()),
            None,
            is_int8_activations=True,
        )


def test_packed_linear_tiles_where_the_build_can(kernels) -> None:
    q4k, q6k = _weight(T.Q4_K, 32, 2, 3), _weight(T.Q6_K, 24, 2, 4)
    x = torch.randn(5, 512)
    for weight in (q4k, q6k):
        fast = PackedLinear(weight, None, kernels, is_int8_activations=True)
        plain = PackedLinear(weight, None, None, is_int8_activations=True)
        # 24 rows are no whole tiles: such a weight keeps the plain layout.
        is_tiled = kernels.has_lane_tiles and fast.is_int8 and weight.num_rows % 16 == 0
        assert fast.weight.is_lane_tiled == is_tiled and not plain.weight.is_lane_tiled
        torch.testing.assert_close(fast(x), plain(x), atol=1e-4, rtol=1e-4)
    # Float activations never tile: the float kernels read the plain layout.
    assert not PackedLinear(q4k, None, kernels).weight.is_lane_tiled
    with pytest.raises(RuntimeError, match="tiled weights"):
        _call(kernels, x, q4k, None, is_tiled=True)
