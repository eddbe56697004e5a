"""Qwen3's decoder block: llama's, with an RMSNorm over each q and each k head (weights
``q_norm`` / ``k_norm`` of ``head_dim``) between the q/k/v projection and RoPE."""

from __future__ import annotations

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer, param
from .decoder_ops import TorchDecoderOps
from .paged_attention import LayerCache, PagedAttention
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
        """See ``LlamaDecoderLayer.attend``; q and k are normalised per head first."""
        qkv = self.norm_qk_heads(self.qkv(h), ops)
        q = ops.rope_write_kv(qkv, rope, kv_cache, attention)
        return attention(q, kv_cache[0], kv_cache[1])

    def norm_qk_heads(self, qkv: torch.Tensor, ops: TorchDecoderOps) -> torch.Tensor:
        """The fused qkv [T, (H + 2 KVH) * D] with q and k RMS-normalised per head (v as it
        is). Each head is a row of a [T * heads, D] matrix, so the ops' row-wise RMSNorm (the
        fused kernel on a CPU) does it in one call per weight."""
        t, d = qkv.shape[0], self.head_dim
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        q = ops.rms_norm(qkv[:, :q_end].reshape(-1, d), self.q_norm, self.eps)
        k = ops.rms_norm(qkv[:, q_end:k_end].reshape(-1, d), self.k_norm, self.eps)
        return torch.cat((q.view(t, -1), k.view(t, -1), qkv[:, k_end:]), dim=1)
