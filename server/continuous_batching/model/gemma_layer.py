"""The Gemma 2/3 decoder block (``gemma`` has the model and what differs from llama)."""

from __future__ import annotations

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer, param
from .decoder_ops import TorchDecoderOps
from .paged_attention import LayerCache, PagedAttention
from .rotary import RopeRows

__all__ = ["GEMMA_FAMILIES", "GemmaDecoderLayer"]

#: ``ModelArchConfig.family`` values of Gemma; "gemma3_text" has q/k norms.
GEMMA_FAMILIES: tuple[str, ...] = ("gemma2", "gemma3_text")


class GemmaDecoderLayer(LlamaDecoderLayer):
    """The Gemma 2/3 block: llama's matmuls with sandwich norms and GeGLU."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype, device)
        hidden, head_dim = config.hidden_size, config.head_dim
        self.pre_feedforward_layernorm = param((hidden,), dtype, device)
        self.post_feedforward_layernorm = param((hidden,), dtype, device)
        self.is_qk_normed = config.family == "gemma3_text"
        self.q_norm = param((head_dim,), dtype, device) if self.is_qk_normed else None
        self.k_norm = param((head_dim,), dtype, device) if self.is_qk_normed else None
        self.attention_scale = config.attention_scale
        self.attn_logit_softcap = config.attn_logit_softcap

    def norm_weights(self) -> list[torch.Tensor]:
        """The block's (1 + w) RMSNorm weights."""
        norms = [
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        ]
        return norms + ([self.q_norm, self.k_norm] if self.is_qk_normed else [])

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """Llama's tensors plus the feed-forward norms (and Gemma 3's q/k norms)."""
        targets = super().hf_weight_targets(c)
        hidden, head_dim = c.hidden_size, c.head_dim
        targets["pre_feedforward_layernorm.weight"] = (self.pre_feedforward_layernorm, 0, hidden)
        targets["post_feedforward_layernorm.weight"] = (self.post_feedforward_layernorm, 0, hidden)
        if self.is_qk_normed:
            targets["self_attn.q_norm.weight"] = (self.q_norm, 0, head_dim)
            targets["self_attn.k_norm.weight"] = (self.k_norm, 0, head_dim)
        return targets

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        rope: RopeRows,
        kv_cache: LayerCache,
        attention: PagedAttention,
        ops: TorchDecoderOps,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``LlamaDecoderLayer.forward``; the attention and MLP outputs are normed before
        they join the residual stream, so the MLP's normed output is always left pending."""
        h = self._norm(x, delta, self.input_layernorm, ops)
        attn = self.o_proj(self.attend(h, rope, kv_cache, attention, ops))
        attn = self._out_norm(attn, self.post_attention_layernorm, ops)
        h = self._norm(x, attn, self.pre_feedforward_layernorm, ops)
        mlp = self.down(ops.gelu_tanh_and_mul(self.gate_up(h)))
        return x, self._out_norm(mlp, self.post_feedforward_layernorm, ops)

    def attend(
        self,
        h: torch.Tensor,
        rope: RopeRows,
        kv_cache: LayerCache,
        attention: PagedAttention,
        ops: TorchDecoderOps,
    ) -> torch.Tensor:
        """Llama's attention with Gemma's score scale and soft cap, and Gemma 3's per-head q/k
        norms before RoPE."""
        qkv = self.qkv(h)
        if self.is_qk_normed:
            qkv = self._qk_normed(qkv, ops)
        q = ops.rope_write_kv(qkv, rope, kv_cache, attention)
        return attention(
            q,
            kv_cache[0],
            kv_cache[1],
            window=self.attention_window,
            softcap=self.attn_logit_softcap,
            scale=self.attention_scale,
        )

    def _qk_normed(self, qkv: torch.Tensor, ops: TorchDecoderOps) -> torch.Tensor:
        """The fused qkv [T, (H + 2 KVH) * D] with each q and k head RMS-normed."""
        t, d = qkv.shape[0], self.head_dim
        q_end = self.num_heads * d
        k_end = q_end + self.num_kv_heads * d
        # float32 in (as transformers' norms compute), one rounding to the weight dtype out.
        q = ops.rms_norm(qkv[:, :q_end].reshape(-1, d).float(), self.q_norm, self.eps)
        k = ops.rms_norm(qkv[:, q_end:k_end].reshape(-1, d).float(), self.k_norm, self.eps)
        return torch.cat([q.view(t, -1), k.view(t, -1), qkv[:, k_end:]], dim=1)

    def _out_norm(
        self, out: torch.Tensor, weight: torch.Tensor, ops: TorchDecoderOps
    ) -> torch.Tensor:
        """RMSNorm of a sublayer's output, from float32 like transformers' Gemma norms."""
        return ops.rms_norm(out.float(), weight, self.eps)
