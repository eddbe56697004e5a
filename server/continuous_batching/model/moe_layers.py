"""Decoder blocks of the mixture-of-experts families: Mixtral (the llama block with
``SparseMoe`` as its MLP) and Qwen3-MoE (q/k norms per head in attention, ``SparseMoe`` in the
layers ``ModelArchConfig.is_moe_layer`` names, a dense MLP in the others)."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer
from .decoder_ops import TorchDecoderOps
from .linear import Packing
from .moe import SparseMoe
from .qwen3 import Qwen3DecoderLayer

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


class Qwen3MoeDenseDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3-MoE layer with a dense MLP (``mlp_only_layers``, ``decoder_sparse_step``):
    Qwen3's block."""


class Qwen3MoeDecoderLayer(MoeDecoderLayer, Qwen3DecoderLayer):
    """A Qwen3-MoE layer with routed experts: the MoE block with Qwen3's q/k norms (the MRO
    runs MoeDecoderLayer, then Qwen3DecoderLayer, then the llama block)."""
