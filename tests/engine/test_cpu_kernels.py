"""The fused CPU kernels (C++ extension) against the torch reference ops and exact float64 math,
at every ISA level this CPU can run (each built with only its own -m flags).

The extensions are built by ``make kernels`` (``python -m server.continuous_batching.model.
cpu_kernels``, every runnable level); here ``load()`` finds them, or builds them once. Where
one cannot be built its tests skip with the reason, except on CI, which builds them and must
run them.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

from server.continuous_batching.model import build_attention_metadata, cpu_kernels
from server.continuous_batching.model.decoder_ops import (
    FusedCpuDecoderOps,
    TorchDecoderOps,
    decoder_ops_for,
)
from server.continuous_batching.model.paged_attention import PagedAttention
from tests.support.cpu_paths import kernel_levels

BLOCK_SIZE = 16
CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module", params=kernel_levels())
def kernels(request):
    module = cpu_kernels.load(request.param)
    if module is None:
        why = f"the fused CPU kernels ({request.param}) could not be built (see the log)"
        if os.environ.get("CI"):
            pytest.fail(why)  # make venv builds them on CI: a missing build is a broken setup
        pytest.skip(why)
    return module


def _random_tables(context_lens: list[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Disjoint, shuffled block lists (a wrong lookup reads another sequence's keys)."""
    needed = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start : start + n])
        start += n
    return tables, num_blocks


def _exact_attention(q, k_cache, v_cache, tables, context_lens) -> torch.Tensor:
    """float64 decode attention, one sequence at a time: [T, H * D]."""
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    rows = []
    for s, length in enumerate(context_lens):
        slots = [tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
        k, v = k_cache[slots].double(), v_cache[slots].double()  # [L, KVH, D]
        qs = q[s].double().view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("grd,lgd->grl", qs, k) * dim**-0.5
        rows.append(torch.einsum("grl,lgd->grd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,dim",
    [(9, 3, 64), (8, 8, 64), (12, 2, 128), (4, 2, 256), (10, 2, 32), (6, 3, 80)],
    ids=["gqa3_d64", "mha_d64", "gqa6_d128", "gqa2_d256", "gqa5_d32", "gqa2_d80"],
)
def test_paged_decode_attention(kernels, dtype, heads, kv_heads, dim) -> None:
    # d64/d128/d256 take the AVX-512 passes (where the CPU has them), d32/d80 the portable loops;
    # rep 6 crosses the four-heads-at-a-time register tiles. Lengths hit 1, block boundaries
    # and odd tails.
    gen = torch.Generator().manual_seed(heads * 100 + dim)
    context_lens = [1, 15, 16, 17, 32, 33, 100, 257]
    tables, num_blocks = _random_tables(context_lens, gen)
    shape = (num_blocks * BLOCK_SIZE, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # q is a strided view, as the model passes it (the k heads follow in the same rows).
    q = torch.randn(len(context_lens), heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    meta = build_attention_metadata(
        [1] * len(context_lens), context_lens, tables, BLOCK_SIZE, CPU, with_decode_tables=True
    )
    out = kernels.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        meta.decode.block_tables,
        meta.decode.context_lens,
        BLOCK_SIZE,
        dim**-0.5,
    )
    assert out.dtype == dtype and out.shape == (len(context_lens), heads, dim)
    exact = _exact_attention(q, k_cache, v_cache, tables, context_lens)
    reference = PagedAttention(
        build_attention_metadata([1] * len(context_lens), context_lens, tables, BLOCK_SIZE, CPU),
        heads,
        kv_heads,
        dim,
        dtype,
    )(q, k_cache, v_cache)
    kernel_error = (out.reshape(len(context_lens), -1).double() - exact).abs().max().item()
    torch_error = (reference.double() - exact).abs().max().item()
    # Float32 inside and one rounding: never worse than the torch path (plus rounding slack).
    assert kernel_error <= max(torch_error, TOLERANCE[dtype] / 4) * 1.01
    assert kernel_error < TOLERANCE[dtype]


@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_attention_alone_equals_in_a_batch(kernels, num_threads) -> None:
    """A row decoded alone (its kv heads in groups per work item, as many as leave two items a
    thread) gives the bits it gets in a batch of 8 (whole sequences per item)."""
    heads, kv_heads, dim = 32, 8, 64
    gen = torch.Generator().manual_seed(7)
    context_lens = [1, 17, 257, 40, 3, 16, 100, 64]
    tables, num_blocks = _random_tables(context_lens, gen)
    shape = (num_blocks * BLOCK_SIZE, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    q = torch.randn(len(context_lens), heads, dim, generator=gen).to(torch.bfloat16)

    def decode(rows: list[int]) -> torch.Tensor:
        lens = [context_lens[r] for r in rows]
        meta = build_attention_metadata(
            [1] * len(rows), lens, [tables[r] for r in rows], BLOCK_SIZE, CPU,
            with_decode_tables=True,
        )  # fmt: skip
        return kernels.paged_decode_attention(
            q[rows], k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens,
            BLOCK_SIZE, dim**-0.5,
        )  # fmt: skip

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = decode(list(range(len(context_lens))))
        for row in (2, 0, 6):
            assert torch.equal(decode([row])[0], batch[row]), row
        assert torch.equal(decode([2, 6]), batch[[2, 6]])
    finally:
        torch.set_num_threads(before)
    exact = _exact_attention(q, k_cache, v_cache, tables, context_lens)
    assert (batch.reshape(len(context_lens), -1).double() - exact).abs().max() < TOLERANCE[
        torch.bfloat16
    ]


def test_attention_through_paged_attention_backend(kernels) -> None:
    # The "cpu" backend of PagedAttention routes decode-only steps to the kernel.
    gen = torch.Generator().manual_seed(1)
    context_lens = [5, 40, 18]
    tables, num_blocks = _random_tables(context_lens, gen)
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, 3, 64, generator=gen)
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, 3, 64, generator=gen)
    q = torch.randn(3, 9, 64, generator=gen)
    kernel_meta = build_attention_metadata(
        [1, 1, 1], context_lens, tables, BLOCK_SIZE, CPU, with_decode_tables=True
    )
    attention = PagedAttention(kernel_meta, 9, 3, 64, torch.float32, "cpu", BLOCK_SIZE, kernels)
    assert attention.is_kernel_step
    torch_meta = build_attention_metadata([1, 1, 1], context_lens, tables, BLOCK_SIZE, CPU)
    expected = PagedAttention(torch_meta, 9, 3, 64, torch.float32)(q, k_cache, v_cache)
    torch.testing.assert_close(attention(q, k_cache, v_cache), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_long_sequence_split_by_kv_head(kernels, dtype) -> None:
    # Fewer sequences than twice the threads: the work items are (sequence, kv head) pairs, and
    # 300 positions cross several online-softmax chunks (a rescale of the running sums).
    gen = torch.Generator().manual_seed(7)
    context_lens = [300]
    tables, num_blocks = _random_tables(context_lens, gen)
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, 3, 64, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, 3, 64, generator=gen).to(dtype)
    # Larger scores for some keys, so the running max moves between chunks.
    k_cache[::37] *= 4
    q = torch.randn(1, 9, 64, generator=gen).to(dtype)
    meta = build_attention_metadata([1], context_lens, tables, BLOCK_SIZE, CPU, True)
    out = kernels.paged_decode_attention(
        q, k_cache, v_cache, meta.decode.block_tables, meta.decode.context_lens, BLOCK_SIZE, 0.125
    )
    exact = _exact_attention(q, k_cache, v_cache, tables, context_lens)
    assert (out.reshape(1, -1).double() - exact).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_step_through_the_kernel(kernels, dtype) -> None:
    # With kernel_takes_prefill every query token is a kernel row attending its own position
    # + 1 keys: a prompt chunk after a cached prefix, a fresh prompt and decodes in one step
    # must match the torch path (masked SDPA for the prompts, batched decode for the rest).
    gen = torch.Generator().manual_seed(3)
    query_lens = [1, 20, 1, 7]
    context_lens = [40, 50, 17, 7]  # sequence 1 has 30 cached tokens before its 20 new ones
    tables, num_blocks = _random_tables(context_lens, gen)
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, 3, 64, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, 3, 64, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), 9, 64, generator=gen).to(dtype)
    kernel_meta = build_attention_metadata(
        query_lens, context_lens, tables, BLOCK_SIZE, CPU, True, kernel_takes_prefill=True
    )
    assert kernel_meta.decode is not None and not kernel_meta.groups
    attention = PagedAttention(kernel_meta, 9, 3, 64, dtype, "cpu", BLOCK_SIZE, kernels)
    assert attention.is_kernel_step
    torch_meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, CPU)
    expected = PagedAttention(torch_meta, 9, 3, 64, dtype)(q, k_cache, v_cache)
    tolerance = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(attention(q, k_cache, v_cache), expected, atol=tolerance, rtol=0)
    # Without the flag a mixed step keeps the torch groups (the Triton backend's contract).
    plain = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, CPU, True)
    assert plain.decode is None and plain.groups


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16,) * 2],
    ids=["f32_resid_bf16", "f32", "bf16"],
)
def test_rms_norm(kernels, x_dtype, w_dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 577, generator=gen) * 3).to(x_dtype)  # odd width: vector tails
    weight = torch.randn(577, generator=gen).to(w_dtype)
    out = FusedCpuDecoderOps(kernels).rms_norm(x, weight, 1e-5)
    expected = TorchDecoderOps().rms_norm(x, weight, 1e-5)
    assert out.dtype == w_dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[w_dtype], rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_add_rms_norm(kernels, dtype) -> None:
    # The float32 residual stream takes a 16-bit layer output in place, then is normalised.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 577, generator=gen) * 3
    delta = torch.randn(7, 577, generator=gen).to(dtype)
    weight = torch.randn(577, generator=gen).to(dtype)
    x_ref = x.clone()
    out = FusedCpuDecoderOps(kernels).add_rms_norm(x, delta, weight, 1e-5)
    expected = TorchDecoderOps().add_rms_norm(x_ref, delta, weight, 1e-5)
    torch.testing.assert_close(x, x_ref, atol=0, rtol=0)  # the same float32 sums, in place
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_silu_and_mul(kernels, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    # Large gates of both signs: sigmoid must neither overflow nor lose its sign.
    gate_up = torch.cat([torch.randn(5, 99, generator=gen) * 30, torch.randn(5, 99)], dim=1)
    gate_up = gate_up.to(dtype)
    out = FusedCpuDecoderOps(kernels).silu_and_mul(gate_up)
    exact = F.silu(gate_up[:, :99].double()) * gate_up[:, 99:].double()
    reference = TorchDecoderOps().silu_and_mul(gate_up.clone())
    kernel_error = (out.double() - exact).abs().max().item()
    assert kernel_error <= (reference.double() - exact).abs().max().item() * 1.01 + 1e-6
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_write_kv(kernels, dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, tokens = 9, 3, 64, 6
    slots = torch.tensor([3, 40, 17, 16, 0, 63])
    meta = build_attention_metadata([tokens], [tokens + 2], [[1, 3, 2, 0]], BLOCK_SIZE, CPU)
    meta.slot_mapping = slots  # any slots: the kernel must write exactly these rows
    attention = PagedAttention(meta, heads, kv_heads, dim, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 50
    angles = torch.cat([angles, angles], dim=1)
    cos = angles.cos().to(dtype)
    sin_signed = torch.cat([-angles[:, : dim // 2].sin(), angles[:, dim // 2 :].sin()], 1).to(dtype)
    caches = {}
    for name, ops in (("torch", TorchDecoderOps()), ("fused", FusedCpuDecoderOps(kernels))):
        k_cache = torch.full((64, kv_heads, dim), 7.0, dtype=dtype)
        v_cache = torch.full((64, kv_heads, dim), 7.0, dtype=dtype)
        q = ops.rope_write_kv(qkv, (cos, sin_signed), (k_cache, v_cache), attention)
        caches[name] = (q, k_cache, v_cache)
    (q_ref, k_ref, v_ref), (q, k, v) = caches["torch"], caches["fused"]
    atol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float(), q_ref.float(), atol=atol * 4, rtol=1e-2)
    torch.testing.assert_close(k.float(), k_ref.float(), atol=atol * 4, rtol=1e-2)
    assert torch.equal(v, v_ref)  # values are copied, not computed
    untouched = torch.ones(64, dtype=torch.bool).index_fill_(0, slots, False)
    assert (k[untouched] == 7).all() and (v[untouched] == 7).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [1000, 1003], ids=["v1000", "v1003_tail"])
def test_refine_logits(kernels, dtype, vocab) -> None:
    # What the torch reference does: every logit widened, a top 8 of each row recomputed
    # exactly in float32. 16-bit logits tie often and torch.topk breaks ties in no documented
    # order; the kernel's rule is the first index wins.
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(5, 64, generator=gen)
    weight = torch.randn(vocab, 64, generator=gen).to(dtype)
    logits = (hidden.to(dtype) @ weight.t()).contiguous()
    logits[1, 10:20] = logits[1].max()  # ten equal best: indices 10..17 are refined
    logits[2, -1] = logits[2].max() + 4  # the best in the last (scalar tail) position
    out = FusedCpuDecoderOps(kernels).refine_logits(logits, hidden, weight, 8)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    exact = (hidden.double() @ weight.double().t()).float()
    widened = logits.float()
    for row in range(5):
        # The kernel's top 8: by value, ties to the first index (a stable descending sort).
        top = torch.sort(widened[row], descending=True, stable=True).indices[:8]
        torch.testing.assert_close(out[row, top], exact[row, top], atol=1e-5, rtol=0)
        rest = torch.ones(vocab, dtype=torch.bool)
        rest[top] = False
        assert torch.equal(out[row, rest], widened[row, rest])
    torch.testing.assert_close(out[1, 10:18], exact[1, 10:18], atol=1e-5, rtol=0)
    assert torch.equal(out[1, 18:20], widened[1, 18:20])
    assert abs(out[2, -1] - exact[2, -1]) < 1e-5 and out[2, -1] != widened[2, -1]  # refined
    # The torch reference agrees wherever the two picked the same candidates.
    expected = TorchDecoderOps().refine_logits(logits, hidden, weight, 8)
    same = (expected == out) | ((expected - out).abs() < 1e-5)
    assert same.float().mean() > 0.99


@pytest.mark.parametrize(
    "rows,k,n,with_bias",
    [
        (1, 576, 960, False),
        (5, 64, 100, True),
        (32, 33, 200, False),
        (9, 576, 49, True),
        (3, 577, 1000, True),
        # 8 rows in one 8 x 3 tile per half group, odd K
        (8, 257, 208, True),
        # 10 row tiles: the next panel prefetched under this one, the last group narrow
        (40, 1030, 200, False),
        # a K past any L2's chunk (cut in K chunks, float32 sums between), odd, 4 row tiles
        (13, 9001, 325, True),
    ],
    ids=[
        "decode1",
        "tail_rows_bias",
        "odd_k",
        "narrow_n",
        "single_rows_odd_k",
        "eight_rows",
        "prefetched_tiles",
        "k_chunks",
    ],
)
def test_bf16_linear(kernels, rows, k, n, with_bias) -> None:
    # The extension's bf16 matmul (register tiles of rows x column blocks, tails in rows, K
    # and N; vdpbf16ps or bf16 widened in registers) against float64 math: exact products,
    # float32 sums, one rounding, so never further from it than the rounding of the result
    # (and than torch's own bf16 matmul).
    from server.continuous_batching.model.linear import Linear

    gen = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    linear = Linear(weight, bias, packing="kernels", kernels=kernels)
    assert linear.kernels is kernels
    out = linear(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    ulp = exact.abs().clamp_min(1e-3) * 2**-8  # one bf16 rounding, plus slack for the sums
    assert ((out.double() - exact).abs() <= ulp).all()
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=0.07, rtol=0.016)


def test_build_failure_falls_back_to_torch_ops(monkeypatch, caplog) -> None:
    def broken(isa: str, verbose: bool) -> None:
        raise OSError("g++: not found")

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            ops = decoder_ops_for(CPU, use_cpu_kernels=True)
        assert ops.attention_backend == "torch"
        assert "unavailable (OSError: g++: not found)" in caplog.text
    finally:
        cpu_kernels.load.cache_clear()


def test_switched_off_by_environment_or_config(monkeypatch) -> None:
    assert decoder_ops_for(CPU, use_cpu_kernels=False).attention_backend == "torch"
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    cpu_kernels.load.cache_clear()
    try:
        assert decoder_ops_for(CPU, use_cpu_kernels=True).attention_backend == "torch"
    finally:
        cpu_kernels.load.cache_clear()


def test_a_build_killed_midway_does_not_block_later_loads(kernels) -> None:
    # cpp_extension's lock file, left behind by a process killed while building, made every
    # later load wait forever; the flock around the build proves it stale and removes it.
    level = kernel_levels()[0]
    (cpu_kernels.build_directory(level) / "lock").touch()
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load(level) is not None
        assert not (cpu_kernels.build_directory(level) / "lock").exists()
    finally:
        cpu_kernels.load.cache_clear()
