"""Decoder blocks of the mixture-of-experts families: Mixtral (the llama block with
``SparseMoe`` as its MLP) and Qwen3-MoE (q/k norms per head in attention, ``SparseMoe`` in the
layers ``ModelArchConfig.is_moe_layer`` names, a dense MLP in the others)."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer, param
from .decoder_ops import TorchDecoderOps
from .linear import Packing
from .moe import SparseMoe
from .paged_attention import LayerCache, PagedAttention
from .qk_norm import apply_qk_norm
from .rotary import RopeRows

#: The dense MLP's entries in ``DENSE_PARAMS`` and its parameters, absent from a MoE block.
_DENSE_MLP = ("gate_up", "down")
_DENSE_MLP_PARAMS = ("gate_up_weight", "gate_up_bias", "down_weight", "down_bias")


class MoeDecoderLayer(LlamaDecoderLayer):
    """The llama block with routed experts (``SparseMoe``) in place of the dense MLP."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        # The base block allocates a dense MLP: a 1-wide one here, dropped right away.
        super().__init__(dataclasses.replace(config, intermediate_size=1), dtype, device)
        for name in _DENSE_MLP_PARAMS:
            setattr(self, name, None)
        for name in _DENSE_MLP:
            delattr(self, name)
            self.replaced.add(name)  # ``finalize`` then leaves them alone
        self.moe = SparseMoe(config, dtype, device)

    def finalize(self, packing: Packing, kernels: ModuleType | None = None) -> None:
        """See ``LlamaDecoderLayer.finalize``; the experts are packed likewise."""
        super().finalize(packing, kernels)
        moe = getattr(self, "moe", None)  # absent while the base __init__ runs
        if moe is not None:
            moe.finalize(packing, kernels)

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """The base block's tensors (its dense MLP's absent) plus the router and experts."""
        targets = super().hf_weight_targets(c)
        return {**targets, **self.moe.hf_weight_targets("mlp.")}

    def feed_forward(
        self, x: torch.Tensor, h: torch.Tensor, ops: TorchDecoderOps
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The experts' float32 output added to the residual stream ``x``."""
        return x + self.moe(h, ops).to(x.dtype), None


class QkNormDecoderLayer(LlamaDecoderLayer):
    """Attention with RMSNorm per q and k head before RoPE (Qwen3's ``q_norm``/``k_norm``)."""

    def _init_qk_norm(
        self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Allocate the [head_dim] q and k norm weights (after the base block)."""
        self.q_norm = param((config.head_dim,), dtype, device)
        self.k_norm = param((config.head_dim,), dtype, device)

    def qk_norm_targets(self) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """HF names of the two norms -> targets."""
        return {
            "self_attn.q_norm.weight": (self.q_norm, 0, self.head_dim),
            "self_attn.k_norm.weight": (self.k_norm, 0, self.head_dim),
        }

    def attend(
        self,
        h: torch.Tensor,
        rope: RopeRows,
        kv_cache: LayerCache,
        attention: PagedAttention,
        ops: TorchDecoderOps,
    ) -> torch.Tensor:
        """See ``LlamaDecoderLayer.attend``; q and k are normed per head before RoPE."""
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


class Qwen3MoeDenseDecoderLayer(QkNormDecoderLayer):
    """A Qwen3-MoE layer with a dense MLP (``mlp_only_layers``, ``decoder_sparse_step``)."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype, device)
        self._init_qk_norm(config, dtype, device)

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """The llama block's tensors plus the q/k norms."""
        return {**super().hf_weight_targets(c), **self.qk_norm_targets()}


class Qwen3MoeDecoderLayer(MoeDecoderLayer, QkNormDecoderLayer):
    """A Qwen3-MoE layer with routed experts."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype, device)
        self._init_qk_norm(config, dtype, device)

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """The MoE block's tensors plus the q/k norms."""
        return {**super().hf_weight_targets(c), **self.qk_norm_targets()}
