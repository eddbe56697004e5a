"""The Triton paged decode-attention and KV-write kernels against the torch reference path.

Without a GPU the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set here,
before the kernel module is first imported (kernels are decorated on first use, see
``triton_paged_attention``). With a GPU they run natively on CUDA tensors. The reference is the
engine's own torch path (``PagedAttention``), computed in float32.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from server.continuous_batching.runner.model_runner import ModelRunner
from tests.support.default_model import greedy_tokens

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton numpy)")

from server.continuous_batching.model import triton_paged_attention as tpa  # noqa: E402
from server.continuous_batching.model.attention import build_attention_metadata  # noqa: E402
from server.continuous_batching.model.decoder_ops import TorchDecoderOps  # noqa: E402
from server.continuous_batching.model.paged_attention import PagedAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _random_tables(
    context_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> list[list[int]]:
    """Disjoint, shuffled block lists (a wrong lookup then reads another sequence's keys)."""
    needed = [-(-n // block_size) for n in context_lens]
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(needed) <= num_blocks
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start : start + n])
        start += n
    return tables


def _case(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((len(context_lens), num_heads, head_dim), generator=gen).to(dtype)
    tables = _random_tables(context_lens, block_size, num_blocks, gen)
    return q, k_cache, v_cache, tables


def _reference(q, k_cache, v_cache, tables, context_lens, block_size) -> torch.Tensor:
    """The engine's torch decode path in float32: [num_seqs, heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    meta = build_attention_metadata(
        [1] * num_seqs, context_lens, tables, block_size, torch.device("cpu")
    )
    attention = PagedAttention(meta, num_heads, k_cache.shape[1], head_dim, torch.float32)
    out = attention(q.float(), k_cache.float(), v_cache.float())
    return out.view(num_seqs, num_heads, head_dim)


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return padded


def _run_kernel(
    q, k_cache, v_cache, tables, context_lens, block_size, **options: object
) -> torch.Tensor:
    padded = _padded(tables)
    out = tpa.paged_decode_attention(
        q.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        padded.to(DEVICE),
        torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_size=block_size,
        **{"max_context_len": max(context_lens), **options},
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    return out.cpu()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "context_lens"),
    [
        # SmolLM2's heads; odd lengths, exact block boundaries, one split over 2 partitions.
        (9, 3, 64, 16, [1, 5, 16, 17, 32, 33, 700]),
        # 32/8 heads, a block size that is no power of two, a head_dim below 16.
        (32, 8, 8, 5, [1, 4, 5, 6, 25, 77]),
        # No GQA, a head_dim that is no power of two.
        (4, 4, 24, 8, [9, 64, 65]),
        # One long sequence split into 4 partitions, exactly on a partition boundary.
        (8, 2, 16, 16, [4 * tpa.PARTITION_SIZE]),
        # Realistic 1B-llama shape: 32/8 heads of 128, a context over 2 partitions plus a tail.
        (32, 8, 128, 16, [2 * tpa.PARTITION_SIZE + 3, 40]),
    ],
)
def test_decode_attention_matches_torch_path_fp32(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, context_lens: list[int]
) -> None:
    args = _case(context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32)
    q, k_cache, v_cache, tables = args
    got = _run_kernel(q, k_cache, v_cache, tables, context_lens, block_size)
    want = _reference(q, k_cache, v_cache, tables, context_lens, block_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_16_bit_inputs(dtype: torch.dtype) -> None:
    """16-bit caches and queries are upcast inside: only the output's rounding differs."""
    context_lens = [3, 48, 600]
    q, k_cache, v_cache, tables = _case(context_lens, 9, 3, 64, 16, dtype, seed=1)
    got = _run_kernel(q, k_cache, v_cache, tables, context_lens, 16)
    want = _reference(q, k_cache, v_cache, tables, context_lens, 16)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("partition", "tile", "max_context_len"),
    [
        (16, 16, None),  # many one-tile partitions
        (64, 32, None),  # a bigger tile
        (1024, 16, None),  # one partition holds every context: no reduce kernel
        (64, 16, 900),  # a graph's bound above every context: the tail partitions are idle
    ],
)
def test_decode_attention_any_partition_and_tile(
    partition: int, tile: int, max_context_len: int | None
) -> None:
    context_lens = [1, 17, 200, 333]
    q, k_cache, v_cache, tables = _case(context_lens, 8, 2, 32, 16, torch.float32, seed=4)
    launch = tpa.DecodeLaunch(tile=tile, num_warps=1, num_stages=1)
    options: dict[str, object] = {"partition": partition, "launch": launch}
    if max_context_len is not None:
        options["max_context_len"] = max_context_len
    got = _run_kernel(q, k_cache, v_cache, tables, context_lens, 16, **options)
    want = _reference(q, k_cache, v_cache, tables, context_lens, 16)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_decode_attention_native_16_bit_dots() -> None:
    """The GPU's 16-bit path (K/V kept in their dtype, tensor-core dots, float32 softmax, P
    rounded for P @ V), run in the interpreter in float16 (its bf16 tl.dot is wrong)."""
    context_lens = [3, 48, 300]
    q, k_cache, v_cache, tables = _case(context_lens, 8, 2, 64, 16, torch.float16, seed=5)
    got = _run_kernel(q, k_cache, v_cache, tables, context_lens, 16, native_dot=True, partition=64)
    want = _reference(q, k_cache, v_cache, tables, context_lens, 16)
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_partition_choice() -> None:
    """Enough programs from the batch alone: one partition per sequence; else split into
    power-of-two multiples of the tile, never below the smallest partition."""
    target = tpa.TARGET_PROGRAMS
    assert tpa.choose_partition(256, 8, 2000, 64) == 2048  # 2048 programs: whole contexts
    assert tpa.choose_partition(256, 8, 100, 64) == 128
    # Batch 1: split down to the smallest partition (32 parts x 8 kv heads).
    assert tpa.choose_partition(1, 8, 2048, 64) == max(64, tpa.PARTITION_SIZE // 8)
    # Batch 4 of 4,096 keys: 4 x 8 x 32 partitions of 128 reach the target.
    assert tpa.choose_partition(4, 8, 4096, 64) == 128 and 4 * 8 * 32 >= target
    for seqs in (1, 2, 7, 32, 65):
        size = tpa.choose_partition(seqs, 8, 4096, 64)
        assert size % 64 == 0 and (size // 64) & (size // 64 - 1) == 0
    assert tpa.choose_partition(1, 1, 1, 16) == 16


def test_decode_attention_reads_a_strided_query() -> None:
    """The engine passes q as a view of the fused q|k projection (rows wider than heads*D)."""
    context_lens = [7, 40]
    q, k_cache, v_cache, tables = _case(context_lens, 9, 3, 16, 4, torch.float32, seed=2)
    fused = torch.cat([q, torch.randn(2, 3, 16)], dim=1)  # [T, heads + kv_heads, D]
    got = _run_kernel(fused[:, :9], k_cache, v_cache, tables, context_lens, 4)
    want = _reference(q, k_cache, v_cache, tables, context_lens, 4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_slots, kv_heads, head_dim = 64, 3, 24
    # Strided k/v views, as the engine's slices of the rotated q|k and of qkv.
    qk = torch.randn((6, 9 + kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((6, kv_heads, head_dim), generator=gen).to(dtype)
    k = qk[:, 9:]
    slots = torch.tensor([5, 0, 63, 17, -1, 18])  # -1: a padded row, never written
    k_cache = torch.randn((num_slots, kv_heads, head_dim), generator=gen).to(dtype)
    v_cache = torch.randn((num_slots, kv_heads, head_dim), generator=gen).to(dtype)
    real = slots >= 0
    want_k = k_cache.clone().index_copy_(0, slots[real], k[real])
    want_v = v_cache.clone().index_copy_(0, slots[real], v[real])
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    tpa.write_kv_cache(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k)
    assert torch.equal(got_v.cpu(), want_v)


def test_module_imports_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only install (no triton) still imports the module and reports it unavailable."""
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    spec = importlib.util.spec_from_file_location("tpa_without_triton", tpa.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    assert not module.is_available(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="triton is not installed"):
        module.write_kv_cache(*[torch.zeros(1, 1, 1)] * 4, torch.zeros(1, dtype=torch.long))


def test_is_available_only_on_cuda() -> None:
    assert not tpa.is_available(torch.device("cpu"))


def test_engine_decodes_through_the_kernels_like_the_torch_path(
    default_model_path: Path, cb_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole GPU decode path but the graph capture, on the real model: decode steps padded
    to buckets, K/V written and attention read by the kernels (interpreted on a CPU), prefill
    through torch. Greedy tokens must equal the plain torch engine's."""
    if DEVICE.type == "cuda":
        pytest.skip("the session's model runner lives on the CPU")
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 7372, 2391, 253, 655, 28, 282], [1, 33]]
    expected = greedy_tokens(cb_runner, default_model_path, prompts, max_new_tokens=5)
    kernel_steps: list[int] = []
    write_kv = tpa.write_kv_cache

    def counting_write_kv(*args: torch.Tensor) -> None:
        kernel_steps.append(args[0].shape[0])
        write_kv(*args)

    monkeypatch.setattr(tpa, "write_kv_cache", counting_write_kv)
    # As on CUDA: torch decoder ops (the fused CPU ones write K/V themselves), triton attention.
    monkeypatch.setattr(cb_runner.model, "decoder_ops", TorchDecoderOps())
    monkeypatch.setattr(cb_runner.model, "attention_backend", "triton")
    monkeypatch.setattr(cb_runner, "attention_backend", "triton")
    monkeypatch.setattr(cb_runner, "is_padding_decodes", True)
    assert greedy_tokens(cb_runner, default_model_path, prompts, 5) == expected
    # 3 sequences -> bucket 4 (one dummy row), then fewer if one stops early.
    assert 4 in kernel_steps and set(kernel_steps) <= {1, 2, 4}
