"""RMSNorm of each query and key head before RoPE (Qwen3, Qwen3-MoE: ``q_norm``/``k_norm``
over ``head_dim``), applied in place to the fused q/k/v projection output; Qwen3's block
(``qwen3.Qwen3DecoderLayer.project_qkv``) calls it, and Qwen3-MoE's blocks inherit that.
Gemma 3 norms from float32 instead, as transformers' Gemma norms do (``gemma_layer``).
"""

from __future__ import annotations

import torch

from .decoder_ops import TorchDecoderOps


def apply_qk_norm(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    ops: TorchDecoderOps,
) -> torch.Tensor:
    """Normalise every q head and every k head of ``qkv`` [T, (H + 2 KVH) * D] in place with
    the [D] weights ``q_weight`` and ``k_weight``; returns ``qkv``. v is left alone."""
    num_tokens = qkv.shape[0]
    q_size, k_size = num_heads * head_dim, num_kv_heads * head_dim
    for start, size, weight in ((0, q_size, q_weight), (q_size, k_size, k_weight)):
        part = qkv[:, start : start + size]
        # One row per head: [T * heads, D] (a copy, as the fused qkv rows are wider).
        heads = part.reshape(-1, head_dim)
        part.copy_(ops.rms_norm(heads, weight, eps).view(num_tokens, size))
    return qkv
