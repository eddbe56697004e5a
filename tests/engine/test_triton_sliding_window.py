"""The Triton decode-attention kernel with a sliding window, soft-capping and a scale, against
the exact answer (``tests.support.windowed_attention``), and through ``PagedAttention``.

Without a GPU the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before
the kernel module is first imported; see ``test_triton_paged_attention``). Blocks before the
windows hold NaN: the kernel must never read them, split-K partitions wholly before the window
included.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton numpy)")

from server.continuous_batching.model import triton_paged_attention as tpa  # noqa: E402
from server.continuous_batching.model.attention import build_attention_metadata  # noqa: E402
from server.continuous_batching.model.decoder_ops import TorchDecoderOps  # noqa: E402
from server.continuous_batching.model.paged_attention import PagedAttention  # noqa: E402
from tests.engine import test_sliding_window_engine as engine_tests  # noqa: E402
from tests.engine.conftest import assert_no_leak  # noqa: E402
from tests.support.windowed_attention import windowed_case  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The tiny Mistral and its transformers tokens (module fixtures, shared by name).
mistral = engine_tests.mistral
prompts = engine_tests.prompts
mistral_tokens = engine_tests.mistral_tokens
CONTEXT_LENS = [70, 33, 5, 17]


def run_kernel(case, partition: int | None, **options: object) -> torch.Tensor:
    meta = build_attention_metadata(
        case.query_lens,
        case.context_lens,
        case.tables,
        case.block_size,
        DEVICE,
        with_decode_tables=True,
    )
    out = tpa.paged_decode_attention(
        case.q.to(DEVICE),
        case.k_cache.to(DEVICE),
        case.v_cache.to(DEVICE),
        meta.decode.block_tables,
        meta.decode.context_lens,
        block_size=case.block_size,
        max_context_len=meta.decode.max_context_len,
        partition=partition,
        window=case.window,
        **options,
    )
    return out.cpu().reshape(len(case.query_lens), -1)


@pytest.mark.parametrize(
    "window,softcap,scale",
    [(20, None, None), (3, None, None), (None, 2.0, 0.3), (9, 1.5, None)],
)
@pytest.mark.parametrize("partition", [16, None], ids=["split_k", "one_partition"])
def test_windowed_decode_matches_exact(window, softcap, scale, partition) -> None:
    # Partitions of 16 keys: with context 70 and window 20, partitions 0..2 lie wholly
    # before the window (they must weigh nothing in the reduce), partition 3 is cut by it.
    case = windowed_case([1] * len(CONTEXT_LENS), CONTEXT_LENS, window, seed=2)
    out = run_kernel(case, partition, softcap=softcap, scale=scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), case.exact(softcap, scale), atol=2e-5, rtol=0)


def test_triton_backend_of_paged_attention() -> None:
    # The "triton" backend passes the layer's window to the kernel.
    case = windowed_case([1] * len(CONTEXT_LENS), CONTEXT_LENS, 12, seed=3)
    meta = build_attention_metadata(
        case.query_lens, case.context_lens, case.tables, 4, DEVICE, with_decode_tables=True
    )
    attention = PagedAttention(meta, 4, 2, 64, torch.float32, "triton", block_size=4)
    assert attention.is_kernel_step
    q, k, v = (t.to(DEVICE) for t in (case.q, case.k_cache, case.v_cache))
    out = attention(q, k, v, window=12, softcap=3.0).cpu()
    torch.testing.assert_close(out.double(), case.exact(softcap=3.0), atol=2e-5, rtol=0)


def test_engine_decodes_windowed_mistral_through_the_kernel(
    mistral,
    prompts,
    mistral_tokens,
    default_model_path,
    monkeypatch,
) -> None:
    """The tiny sliding-window Mistral of ``test_sliding_window_engine`` with decode steps on
    the Triton kernels (K/V writes and attention, padded to buckets; interpreted on a CPU),
    prefill through torch, freed blocks left as NULL_BLOCK in the tables: transformers'
    tokens."""
    if DEVICE.type == "cuda":
        pytest.skip("the tiny engine's runner lives on the CPU")
    engine = engine_tests.tiny_engine(mistral[0], default_model_path, None)
    runner = engine.runner
    calls: list[int | None] = []
    decode = tpa.paged_decode_attention

    def recording_decode(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("window"))
        return decode(*args, **kwargs)

    monkeypatch.setattr(tpa, "paged_decode_attention", recording_decode)
    monkeypatch.setattr(runner.model, "decoder_ops", TorchDecoderOps())
    monkeypatch.setattr(runner.model, "attention_backend", "triton")
    monkeypatch.setattr(runner, "attention_backend", "triton")
    monkeypatch.setattr(runner, "is_padding_decodes", True)
    assert engine_tests.engine_greedy(engine, prompts) == mistral_tokens
    assert calls and set(calls) == {engine_tests.WINDOW}
    assert_no_leak(engine)
