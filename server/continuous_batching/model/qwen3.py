"""Qwen3's decoder block: llama's, with an RMSNorm over each q and each k head (weights
``q_norm`` / ``k_norm`` of ``head_dim``) between the q/k/v projection and RoPE. Qwen3-MoE's
blocks build on it (``moe_layers``)."""

from __future__ import annotations

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer, param
from .decoder_ops import TorchDecoderOps
from .qk_norm import apply_qk_norm


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

    def project_qkv(self, h: torch.Tensor, ops: TorchDecoderOps) -> torch.Tensor:
        """The q/k/v projection with q and k normalised per head (the ops' row-wise RMSNorm
        over [T * heads, head_dim]: the fused kernel on a CPU)."""
        return apply_qk_norm(
            self.qkv(h),
            self.q_norm,
            self.k_norm,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            ops,
        )
