"""Per-layer attention options of ``PagedAttention`` (sliding window, soft-capping, scale) on
the torch reference path and the CPU kernel at every ISA level, against the exact answer.

One step mixes decodes, a fresh prompt and a prompt chunk after a cached prefix; keys before
the windows sit in poisoned blocks (NaN for the kernel, which must never read them; huge
finite values for the torch path, which reads them under its mask) and, as the engine gives
them after freeing, as -1 in the tables the torch path gets.
"""

from __future__ import annotations

import pytest
import torch

from server.continuous_batching.model import paged_attention
from server.continuous_batching.model.attention import build_attention_metadata
from server.continuous_batching.model.paged_attention import PagedAttention
from tests.support.cpu_paths import built_kernels, kernel_levels
from tests.support.windowed_attention import WindowedCase, windowed_case

CPU = torch.device("cpu")
QUERY_LENS = [1, 1, 9, 13, 1]
CONTEXT_LENS = [37, 6, 9, 50, 21]
#: (window, softcap, scale): a window shorter than a block, one of several blocks, none;
#: soft-capping and a scale alone and with a window.
OPTIONS = [(3, None, None), (10, None, None), (None, None, None), (None, 2.0, 0.3), (7, 1.5, None)]


def run(case: WindowedCase, backend: str, kernels=None, **options) -> torch.Tensor:
    is_kernel = backend != "torch"
    tables = case.tables if is_kernel else case.null_tables
    meta = build_attention_metadata(
        case.query_lens,
        case.context_lens,
        tables,
        case.block_size,
        CPU,
        with_decode_tables=is_kernel,
        kernel_takes_prefill=is_kernel,
    )
    heads, dim = case.q.shape[1], case.q.shape[2]
    attention = PagedAttention(
        meta, heads, case.k_cache.shape[1], dim, case.q.dtype, backend, case.block_size, kernels
    )
    assert attention.is_kernel_step == is_kernel
    return attention(case.q, case.k_cache, case.v_cache, window=case.window, **options)


@pytest.mark.parametrize("window,softcap,scale", OPTIONS)
@pytest.mark.parametrize("max_kv_heads", [4, 0], ids=["block_diagonal", "per_head"])
def test_torch_path_options(window, softcap, scale, max_kv_heads, monkeypatch) -> None:
    monkeypatch.setattr(paged_attention, "BLOCK_DIAGONAL_MAX_KV_HEADS", max_kv_heads)
    case = windowed_case(QUERY_LENS, CONTEXT_LENS, window, poison=1e4)
    out = run(case, "torch", softcap=softcap, scale=scale)
    torch.testing.assert_close(out.double(), case.exact(softcap, scale), atol=1e-5, rtol=0)


def test_window_changes_the_answer() -> None:
    # The window must matter: full attention over the same (unpoisoned) cache differs.
    case = windowed_case(QUERY_LENS, CONTEXT_LENS, 10, poison=0.5)
    full = windowed_case(QUERY_LENS, CONTEXT_LENS, None)
    full.k_cache, full.v_cache = case.k_cache, case.v_cache
    assert (run(case, "torch").double() - full.exact()).abs().max() > 1e-2


@pytest.fixture(scope="module", params=kernel_levels())
def kernels(request):
    return built_kernels(request.param)


@pytest.mark.parametrize("window,softcap,scale", OPTIONS)
@pytest.mark.parametrize("dim", [64, 32], ids=["d64_vector", "d32_portable"])
def test_cpu_kernel_options(kernels, window, softcap, scale, dim) -> None:
    # d64 takes the vector pass with its online softmax, d32 the portable loops.
    case = windowed_case(QUERY_LENS, CONTEXT_LENS, window, dim=dim)
    out = run(case, "cpu", kernels, softcap=softcap, scale=scale)
    assert not out.isnan().any()  # no freed (poisoned) block was read
    torch.testing.assert_close(out.double(), case.exact(softcap, scale), atol=1e-5, rtol=0)


def test_cpu_kernel_long_window_crosses_chunks(kernels) -> None:
    # 300 positions with a window of 150: the vector pass starts mid-table and runs several
    # online-softmax chunks from there, in bfloat16 too.
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        case = windowed_case([1, 4], [300, 280], 150, heads=6, kv_heads=2, dtype=dtype)
        out = run(case, "cpu", kernels)
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), case.exact(), atol=atol, rtol=0)
