"""Gemma's element-wise and attention steps: GELU-tanh-and-mul, and attention with a score
scale of its own and soft-capped scores, in the torch reference paths (decode in both layouts,
prefill) and the fused CPU kernels at every ISA level, against exact float64 math."""

from __future__ import annotations

import math

import pytest
import torch

from server.continuous_batching.model import build_attention_metadata, paged_attention
from server.continuous_batching.model.decoder_ops import FusedCpuDecoderOps, TorchDecoderOps
from server.continuous_batching.model.paged_attention import PagedAttention
from tests.engine.test_cpu_kernels import BLOCK_SIZE, CPU, TOLERANCE, _random_tables, kernels

__all__ = ["kernels"]  # the fixture, re-exported so pytest finds it here

SCALE = 48**-0.5
SOFTCAP = 2.5


def _exact_gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    inner = math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    return 0.5 * g * (1 + torch.tanh(inner)) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gelu_tanh_and_mul(kernels, dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    # Large gates of both signs (tanh saturates) and small ones (the cubic term matters).
    gate = torch.cat([torch.randn(6, 50, generator=gen) * 20, torch.randn(6, 51, generator=gen)], 1)
    gate_up = torch.cat([gate, torch.randn(6, 101, generator=gen)], dim=1).to(dtype)
    exact = _exact_gelu_tanh_and_mul(gate_up)
    reference = TorchDecoderOps().gelu_tanh_and_mul(gate_up.clone())
    out = FusedCpuDecoderOps(kernels).gelu_tanh_and_mul(gate_up)
    assert out.dtype == dtype and out.shape == (6, 101)
    reference_error = (reference.double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= reference_error * 1.01 + 1e-6
    assert reference_error < TOLERANCE[dtype] * exact.abs().max().item()


def _exact_attention(q, k_cache, v_cache, tables, query_lens, context_lens) -> torch.Tensor:
    """float64 causal attention with SCALE and SOFTCAP, token by token: [T, H * D]."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    rows, t = [], 0
    for s, (q_len, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        for pos in range(ctx - q_len, ctx):
            slots = [
                tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(pos + 1)
            ]
            k, v = k_cache[slots].double(), v_cache[slots].double()
            qs = q[t].double().view(kv_heads, heads // kv_heads, dim)
            scores = torch.einsum("grd,lgd->grl", qs, k) * SCALE
            scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
            rows.append(torch.einsum("grl,lgd->grd", scores.softmax(-1), v).reshape(-1))
            t += 1
    return torch.stack(rows)


def _case(query_lens, context_lens, heads, kv_heads, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = _random_tables(context_lens, gen)
    shape = (num_blocks * BLOCK_SIZE, kv_heads, dim)
    # Scores of several units: the cap changes them a lot.
    k_cache = (torch.randn(shape, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = (torch.randn(sum(query_lens), heads, dim, generator=gen) * 2).to(dtype)
    exact = _exact_attention(q, k_cache, v_cache, tables, query_lens, context_lens)
    return q, k_cache, v_cache, tables, exact


def _attend(meta, q, k_cache, v_cache, backend="torch", module=None) -> torch.Tensor:
    """Attention of a step with SCALE and SOFTCAP (6 heads over 2 kv heads)."""
    attention = PagedAttention(meta, 6, 2, q.shape[2], q.dtype, backend, BLOCK_SIZE, module)
    assert attention.is_kernel_step == (backend != "torch")
    return attention(q, k_cache, v_cache, softcap=SOFTCAP, scale=SCALE)


@pytest.mark.parametrize("max_kv_heads", [4, 0], ids=["block_diagonal", "per_head"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 7, 1, 12]], ids=["decode", "mixed"])
def test_torch_paths_soft_cap_before_the_mask(query_lens, max_kv_heads, monkeypatch) -> None:
    # Decode in both layouts, and prefill (which leaves SDPA for explicit capped scores).
    monkeypatch.setattr(paged_attention, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    context_lens = [3, 17, 40, 12]
    q, k_cache, v_cache, tables, exact = _case(query_lens, context_lens, 6, 2, 16, torch.float32, 1)
    meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, CPU)
    out = _attend(meta, q, k_cache, v_cache)
    torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=0)
    # The cap matters here: uncapped attention is far from it.
    plain = PagedAttention(meta, 6, 2, 16, torch.float32)(q, k_cache, v_cache, scale=SCALE)
    assert (plain.double() - exact).abs().max().item() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 16], ids=["d64_vector", "d16_portable"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 7, 1, 12]], ids=["decode", "mixed"])
def test_cpu_kernel_soft_caps_like_exact(kernels, dtype, dim, query_lens) -> None:
    # The kernel takes decode rows and prefill tokens alike (kernel_takes_prefill).
    context_lens = [3, 17, 40, 12]
    q, k_cache, v_cache, tables, exact = _case(query_lens, context_lens, 6, 2, dim, dtype, dim)
    meta = build_attention_metadata(
        query_lens,
        context_lens,
        tables,
        BLOCK_SIZE,
        CPU,
        with_decode_tables=True,
        kernel_takes_prefill=True,
    )
    out = _attend(meta, q, k_cache, v_cache, "cpu", kernels)
    torch_meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, CPU)
    reference = _attend(torch_meta, q, k_cache, v_cache)
    kernel_error = (out.double() - exact).abs().max().item()
    torch_error = (reference.double() - exact).abs().max().item()
    assert kernel_error <= max(torch_error, TOLERANCE[dtype] / 4) * 1.01
    assert kernel_error < TOLERANCE[dtype]
