"""Gemma 2 and Gemma 3 (text) on the llama block and model (config: ``families.gemma``).

What differs from llama, and where it is done here:

* RMSNorms multiply by ``(1 + w)`` (computed in float32 in transformers). ``finalize`` adds 1
  to every norm weight once after loading, so the plain rms_norm ops and kernels run them
  unchanged: exact in float32; a 16-bit model rounds ``1 + w`` to its dtype once.
* Four norms per block: the attention output and the MLP output are normed before their
  residual adds (``gemma_layer.GemmaDecoderLayer.forward``); Gemma 3 also norms q and k per
  head before RoPE.
* GeGLU with the tanh GELU (``gelu_tanh_and_mul``).
* Embeddings times sqrt(hidden), the factor rounded to the model dtype as transformers does.
* Scores scaled by ``query_pre_attn_scalar ** -0.5`` and, in Gemma 2, soft-capped (the
  block passes ``attention_scale``/``attn_logit_softcap`` to each attention call, with its
  layer's sliding window); output logits soft-capped (``compute_logits``).
* Gemma 3's sliding-window layers have their own RoPE base (``layer_ropes``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .architecture import ModelArchConfig
from .cpu_isa import CpuPath
from .gemma_layer import GEMMA_FAMILIES, GemmaDecoderLayer
from .llama import LlamaForCausalLM
from .rotary import RopeRows, RotaryTables

__all__ = ["GEMMA_FAMILIES", "GemmaDecoderLayer", "GemmaForCausalLM"]


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2/3 text model: the llama model with the differences of the module docstring."""

    def __init__(
        self,
        config: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        use_cpu_kernels: bool = True,
        cpu_path: CpuPath | None = None,
    ) -> None:
        super().__init__(config, dtype, device, use_cpu_kernels, cpu_path)
        # transformers multiplies by sqrt(hidden) rounded to the model dtype.
        self.embed_multiplier = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
        self.sliding_rotary: RotaryTables | None = None
        if config.sliding_rope_theta is not None:
            local = replace(
                config,
                rope_theta=config.sliding_rope_theta,
                rope_scaling=config.sliding_rope_scaling,
            )
            self.sliding_rotary = RotaryTables(local, dtype, self.device)
        self.is_norm_folded = False

    def norm_weights(self) -> list[torch.Tensor]:
        """Every (1 + w) RMSNorm weight of the model."""
        return [self.norm] + [w for layer in self.layers for w in layer.norm_weights()]

    def finalize(self) -> None:
        """Fold the ``1 +`` of Gemma's norms into their weights (once), then llama's
        finalize. Call after the weights are loaded."""
        if not self.is_norm_folded:
            with torch.no_grad():
                for weight in self.norm_weights():
                    weight.add_(1.0)
            self.is_norm_folded = True
        super().finalize()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times sqrt(hidden), multiplied in the model dtype (as transformers)."""
        x = self.embedding_rows(input_ids) * self.embed_multiplier
        return x.to(self.residual_dtype)

    def layer_ropes(self, positions: torch.Tensor) -> list[RopeRows]:
        """Gemma 3: the local rope for sliding-window layers, the global one elsewhere."""
        if self.sliding_rotary is None:
            return super().layer_ropes(positions)
        full = self.rotary.lookup(positions)
        local = self.sliding_rotary.lookup(positions)
        types = self.config.layer_types
        return [local if types[i] == "sliding_attention" else full for i in range(len(self.layers))]

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama's logits, soft-capped when the config says so (Gemma 2). The cap is
        monotonic, so the refined candidates are still each row's best."""
        logits = super().compute_logits(hidden_states)
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits
        return logits.div_(cap).tanh_().mul_(cap)
