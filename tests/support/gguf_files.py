"""Quantised GGUF test data: random raw blocks of every packable type (gguf's own quantiser
for the types it writes, bytewise blocks for the K-quants it cannot), and small random llama
models written with gguf's ``GGUFWriter``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

#: The types gguf 0.19 can quantise itself.
QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1)
#: (offset of d in the block, offset of dmin or None) for the K-quants written bytewise.
_K_SCALE_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, None)}
_BLOCK_BYTES = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def _set_fp16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[..., offset : offset + 2] = (
        values.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:-1], 2)
    )


def random_blocks(qtype: T, rows: int, k: int, rng: np.random.Generator, std: float = 0.05):
    """uint8 [rows, bytes per row]: a random [rows, k] matrix of ``qtype`` whose dequantised
    values have a standard deviation near ``std``."""
    if qtype in QUANTIZABLE:
        return quantize((rng.standard_normal((rows, k)) * std).astype(np.float32), qtype)
    size = _BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    d_at, dmin_at = _K_SCALE_FIELDS[qtype]
    # dmin * m near the mean of d * sc * q (codes 0..15 or 0..31): rows of mean about zero,
    # as real weights are (else a random model's logits favour one token whatever the input).
    ratio = 7.5 if qtype == T.Q4_K else 15.5
    shape = blocks.shape[:-1]
    _set_fp16(blocks, d_at, np.ones(shape))
    if dmin_at is not None:
        _set_fp16(blocks, dmin_at, np.full(shape, ratio))
    unit = float(dequantize(blocks.reshape(rows, -1), qtype).std())
    # d and dmin scale every value: set them per block around the target, a little varied.
    scale = std / unit * rng.uniform(0.5, 1.5, shape)
    _set_fp16(blocks, d_at, scale)
    if dmin_at is not None:
        _set_fp16(blocks, dmin_at, scale * ratio * rng.uniform(0.9, 1.1, shape))
    return blocks.reshape(rows, -1)


#: The tiny llama's shapes: K of every matmul a multiple of 256 (the K-quants' super-block).
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 320, 2


def _layer_shapes() -> dict[str, tuple[int, int]]:
    head_dim = HIDDEN // HEADS
    return {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }


def _add_matrix(writer: GGUFWriter, name: str, shape, qtype: T, rng) -> None:
    rows, k = shape
    if qtype in (T.F32, T.F16):
        dtype = np.float32 if qtype == T.F32 else np.float16
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(dtype))
        return
    writer.add_tensor(name, random_blocks(qtype, rows, k, rng), raw_dtype=qtype)


def write_tiny_llama(
    path: Path,
    types: dict[str, T],
    default: T,
    is_tied: bool = True,
    seed: int = 0,
) -> Path:
    """A random 2-layer llama GGUF at ``path``: matrices of type ``default`` unless ``types``
    names another for a GGUF tensor kind ("attn_v", "ffn_down", "token_embd", "output");
    norms float32; an ``output.weight`` unless ``is_tied``."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    _add_matrix(writer, "token_embd.weight", (VOCAB, HIDDEN), types.get("token_embd", default), rng)
    for i in range(LAYERS):
        for kind, shape in _layer_shapes().items():
            _add_matrix(writer, f"blk.{i}.{kind}.weight", shape, types.get(kind, default), rng)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(HIDDEN, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not is_tied:
        _add_matrix(writer, "output.weight", (VOCAB, HIDDEN), types.get("output", default), rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
