"""The fused Triton element-wise kernels (``triton_fused``) against the torch decoder ops.

Without a GPU the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` set before
the kernel module is first imported, as in ``test_triton_paged_attention``). The reference is
``TorchDecoderOps``: float32 results agree to rounding, 16-bit ones to the last bit or two
(torch rounds after each op, the kernels once).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import greedy_tokens

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton numpy)")

from server.continuous_batching.model import triton_fused  # noqa: E402
from server.continuous_batching.model.decoder_ops import TorchDecoderOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TORCH = TorchDecoderOps()
FUSED = triton_fused.TritonDecoderOps()
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    """A 16-bit model normalises its float32 residual stream into its own dtype."""
    x = _randn(5, hidden, seed=1) * 3
    weight = _randn(hidden, dtype=dtype, seed=2)
    got = FUSED.rms_norm(x, weight, 1e-5)
    want = TORCH.rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_the_residual_in_place(dtype: torch.dtype) -> None:
    x = _randn(7, 96, seed=3)
    delta = _randn(7, 96, dtype=dtype, seed=4)
    weight = _randn(96, dtype=dtype, seed=5)
    x_fused, x_torch = x.clone(), x.clone()
    got = FUSED.add_rms_norm(x_fused, delta, weight, 1e-6)
    want = TORCH.add_rms_norm(x_torch, delta, weight, 1e-6)
    torch.testing.assert_close(x_fused, x_torch, atol=0, rtol=0)  # one float32 add each
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    """Two programs per row (inter 1500 > the block of 1024), the tail masked."""
    gate_up = _randn(3, 2 * 1500, dtype=dtype, seed=6) * 4
    got = FUSED.silu_and_mul(gate_up)
    want = TORCH.silu_and_mul(gate_up)
    assert got.shape == (3, 1500) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


class _Attention(SimpleNamespace):
    """What ``rope_write_kv`` reads of a PagedAttention: heads, the slots, write_kv."""

    def write_kv(self, k, v, k_cache, v_cache) -> None:
        real = self.meta.slot_mapping >= 0
        slots = self.meta.slot_mapping[real]
        k_cache.index_copy_(0, slots, k[real])
        v_cache.index_copy_(0, slots, v[real])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 24)])
def test_rope_write_kv(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """q rotated and returned, k rotated and v stored at their slots (-1 skipped), the other
    slots of the cache untouched."""
    tokens, num_slots = 6, 40
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    angles = _randn(tokens, head_dim // 2, seed=8)
    cos = torch.cat([angles.cos()] * 2, dim=1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=1).to(dtype)
    slots = torch.tensor([3, 0, 39, -1, 17, 18], device=DEVICE)
    attention = _Attention(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        meta=SimpleNamespace(slot_mapping=slots),
    )
    caches = [_randn(num_slots, kv_heads, head_dim, dtype=dtype, seed=s) for s in (9, 10)]
    fused_cache = tuple(c.clone() for c in caches)
    torch_cache = tuple(c.clone() for c in caches)
    got = FUSED.rope_write_kv(qkv, (cos, sin), fused_cache, attention)
    want = TORCH.rope_write_kv(qkv, (cos, sin), torch_cache, attention)
    assert got.shape == (tokens, heads, head_dim) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(fused_cache[0], torch_cache[0], **TOLERANCE[dtype])
    torch.testing.assert_close(fused_cache[1], torch_cache[1], atol=0, rtol=0)  # v: a copy


def test_only_16_bit_models_on_cuda_take_the_fused_ops() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_fused.is_available(cuda, torch.bfloat16)
    assert triton_fused.is_available(cuda, torch.float16)
    assert not triton_fused.is_available(cuda, torch.float32)  # parity: torch's rounding
    assert not triton_fused.is_available(cpu, torch.bfloat16)


def test_engine_decodes_through_the_fused_ops_like_the_torch_path(
    default_model_path: Path, cb_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused ops on the real (float32) model with the GPU's decode path but the graphs:
    every step's norms, SiLU and RoPE + cache writes through the kernels (interpreted on a
    CPU), decode attention through the Triton kernel. Greedy tokens equal the torch engine's."""
    if DEVICE.type == "cuda":
        pytest.skip("the session's model runner lives on the CPU")
    # Small: the interpreter runs every kernel of 30 layers op by op (~2 s a step).
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 33]]
    expected = greedy_tokens(cb_runner, default_model_path, prompts, max_new_tokens=3)
    calls: list[str] = []
    rope = FUSED.rope_write_kv

    def counting_rope(*args: object) -> torch.Tensor:
        calls.append("rope")
        return rope(*args)

    ops = triton_fused.TritonDecoderOps()
    monkeypatch.setattr(ops, "rope_write_kv", counting_rope)
    monkeypatch.setattr(cb_runner.model, "decoder_ops", ops)
    monkeypatch.setattr(cb_runner.model, "attention_backend", "triton")
    monkeypatch.setattr(cb_runner, "attention_backend", "triton")
    monkeypatch.setattr(cb_runner, "is_padding_decodes", True)
    assert greedy_tokens(cb_runner, default_model_path, prompts, 3) == expected
    assert calls
