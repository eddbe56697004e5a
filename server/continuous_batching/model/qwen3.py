"""Qwen3's decoder block: llama's, with an RMSNorm over each q and each k head (weights
``q_norm`` / ``k_norm`` of ``head_dim``) between the q/k/v projection and RoPE."""

from __future__ import annotations

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer, param
from .decoder_ops import TorchDecoderOps
from .paged_attention import LayerCache, PagedAttention
from .qk_norm import apply_qk_norm
from .rotary import RopeRows


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """The llama block with per-head q/k RMSNorm before RoPE (see the module docstring)."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype, device)
        self.q_norm = param((config.head_dim,), dtype, device)
        self.k_norm = param((config.head_dim,), dtype, device)

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """Llama's tensors plus ``self_attn.q_norm`` / ``self_attn.k_norm``."""
        targets = super().hf_weight_targets(c)
        targets["self_attn.q_norm.weight"] = (self.q_norm, 0, c.head_dim)
        targets["self_attn.k_norm.weight"] = (self.k_norm, 0, c.head_dim)
        return targets

    def attend(
        self,
        h: torch.Tensor,
        rope: RopeRows,
        kv_cache: LayerCache,
        attention: PagedAttention,
        ops: TorchDecoderOps,
    ) -> torch.Tensor:
        """See ``LlamaDecoderLayer.attend``; q and k are normalised per head first (the ops'
        row-wise RMSNorm over [T * heads, head_dim]: the fused kernel on a CPU)."""
        qkv = apply_qk_norm(
            self.qkv(h),
            self.q_norm,
            self.k_norm,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            ops,
        )
        q = ops.rope_write_kv(qkv, rope, kv_cache, attention)
        return attention(q, kv_cache[0], kv_cache[1], window=self.attention_window)
