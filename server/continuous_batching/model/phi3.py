"""Phi-3's decoder block: llama's, loaded from checkpoints that store q/k/v as one
``self_attn.qkv_proj`` and gate/up as one ``mlp.gate_up_proj`` (already our fused layout:
rows q, k, v and gate, up). LongRoPE and the partial rotary factor live in ``rotary``."""

from __future__ import annotations

import torch

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer


class Phi3DecoderLayer(LlamaDecoderLayer):
    """The llama block under Phi-3's fused tensor names."""

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """Llama's norms and o/down projections; q/k/v and gate/up as the fused tensors
        (the split names would also load, e.g. from a GGUF, but a checkpoint gives one or the
        other, and every target must be filled: so only the fused names are listed)."""
        targets = super().hf_weight_targets(c)
        for split in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            for kind in ("weight", "bias"):
                targets.pop(f"{split}.{kind}")
        for split in ("mlp.gate_proj", "mlp.up_proj"):
            for kind in ("weight", "bias"):
                targets.pop(f"{split}.{kind}")
        qkv_rows, gate_up_rows = c.q_size + 2 * c.kv_size, 2 * c.intermediate_size
        targets["self_attn.qkv_proj.weight"] = (self.qkv_weight, 0, qkv_rows)
        targets["self_attn.qkv_proj.bias"] = (self.qkv_bias, 0, qkv_rows)
        targets["mlp.gate_up_proj.weight"] = (self.gate_up_weight, 0, gate_up_rows)
        targets["mlp.gate_up_proj.bias"] = (self.gate_up_bias, 0, gate_up_rows)
        return targets
