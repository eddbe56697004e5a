"""One decoder block of the llama family, the base every family's block builds on.

q/k/v and gate/up are fused into single weight matrices. ``forward`` is the llama block:
RMSNorm, attention (``attend``), o_proj with the residual add, RMSNorm, the feed-forward
(``feed_forward``). Families change what differs by overriding those hooks (Qwen3's q/k norms
in ``attend``, a mixture of experts in ``feed_forward``) or ``forward`` itself, and add their
tensors in ``hf_weight_targets``; ``layer_classes`` maps a family to its block.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from .architecture import ModelArchConfig
from .decoder_ops import TorchDecoderOps
from .linear import Linear, LinearLike, Packing
from .paged_attention import LayerCache, PagedAttention
from .rotary import RopeRows

__all__ = ["DENSE_PARAMS", "LlamaDecoderLayer", "param"]


#: The four matmuls of a layer -> the (weight, bias) parameters a dense ``Linear`` is built from.
DENSE_PARAMS: dict[str, tuple[str, str]] = {
    "qkv": ("qkv_weight", "qkv_bias"),
    "o_proj": ("o_weight", "o_bias"),
    "gate_up": ("gate_up_weight", "gate_up_bias"),
    "down": ("down_weight", "down_bias"),
}


def param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Uninitialised inference-only parameter (the loader fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class LlamaDecoderLayer(nn.Module):
    """One transformer block with q/k/v and gate/up fused into single weight matrices."""

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        qkv_rows = config.q_size + 2 * config.kv_size
        self.input_layernorm = param((hidden,), dtype, device)
        self.qkv_weight = param((qkv_rows, hidden), dtype, device)
        self.qkv_bias = param((qkv_rows,), dtype, device) if config.attention_bias else None
        self.o_weight = param((hidden, config.q_size), dtype, device)
        self.o_bias = param((hidden,), dtype, device) if config.o_proj_bias else None
        self.post_attention_layernorm = param((hidden,), dtype, device)
        self.gate_up_weight = param((2 * inter, hidden), dtype, device)
        self.gate_up_bias = param((2 * inter,), dtype, device) if config.mlp_bias else None
        self.down_weight = param((hidden, inter), dtype, device)
        self.down_bias = param((hidden,), dtype, device) if config.mlp_bias else None
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.inter = inter
        #: This layer's sliding attention window in tokens (None: full attention); the model
        #: sets it from ``config.window_of(layer_index)``.
        self.attention_window: int | None = None
        #: Matmuls installed by ``replace_linears`` (quantised); ``finalize`` keeps them.
        self.replaced: set[str] = set()
        self.finalize("none")

    def finalize(self, packing: Packing, kernels: ModuleType | None = None) -> None:
        """Build the dense matmul callables from the (loaded) parameters, packed as
        ``packing`` says (``kernels``: the fused CPU extension; see ``Linear``).

        Prepacking is final: the plain weights are released (the packed copy replaces them),
        so the model holds each matrix once.
        """
        for name, (weight, bias) in DENSE_PARAMS.items():
            if name in self.replaced:
                continue
            param = getattr(self, weight)
            if param is None or param.numel() == 0:
                raise RuntimeError("finalize() after prepacking: the plain weights are gone")
            setattr(self, name, Linear(param, getattr(self, bias), packing, kernels))
            if packing != "none":
                param.data = param.data.new_empty(0)

    def replace_linears(self, linears: dict[str, LinearLike]) -> None:
        """Install other implementations (e.g. GPTQ int4) of some of the four matmuls, keyed
        as in ``DENSE_PARAMS``, and drop the dense parameters they stand in for: the memory
        saving of a quantised checkpoint is the point, and the loader then no longer expects
        those tensors (``hf_weight_targets`` skips absent parameters)."""
        for name, linear in linears.items():
            weight, bias = DENSE_PARAMS[name]
            setattr(self, weight, None)
            setattr(self, bias, None)
            setattr(self, name, linear)
            self.replaced.add(name)

    def hf_weight_targets(
        self, c: ModelArchConfig
    ) -> dict[str, tuple[torch.Tensor | None, int, int]]:
        """HF tensor names within a layer -> (parameter or None if absent, row range)."""
        q, kv, inter, hidden = c.q_size, c.kv_size, c.intermediate_size, c.hidden_size
        fused = {
            "self_attn.q_proj": (self.qkv_weight, self.qkv_bias, 0, q),
            "self_attn.k_proj": (self.qkv_weight, self.qkv_bias, q, q + kv),
            "self_attn.v_proj": (self.qkv_weight, self.qkv_bias, q + kv, q + 2 * kv),
            "self_attn.o_proj": (self.o_weight, self.o_bias, 0, hidden),
            "mlp.gate_proj": (self.gate_up_weight, self.gate_up_bias, 0, inter),
            "mlp.up_proj": (self.gate_up_weight, self.gate_up_bias, inter, 2 * inter),
            "mlp.down_proj": (self.down_weight, self.down_bias, 0, hidden),
        }
        targets: dict[str, tuple[torch.Tensor | None, int, int]] = {
            "input_layernorm.weight": (self.input_layernorm, 0, hidden),
            "post_attention_layernorm.weight": (self.post_attention_layernorm, 0, hidden),
        }
        for name, (weight, bias, start, end) in fused.items():
            targets[f"{name}.weight"] = (weight, start, end)
            targets[f"{name}.bias"] = (bias, start, end)
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
        """x: residual stream [T, hidden]; delta: the previous layer's output not yet added
        to it (None: nothing pending). Returns (x, delta) likewise: a 16-bit model's float32
        stream takes each output in the next norm's pass (``add_rms_norm``)."""
        h = self._norm(x, delta, self.input_layernorm, ops)
        attn = self.attend(h, rope, kv_cache, attention, ops)
        x, delta = self._residual(x, self.o_proj, attn)
        h = self._norm(x, delta, self.post_attention_layernorm, ops)
        return self.feed_forward(x, h, ops)

    def project_qkv(self, h: torch.Tensor, ops: TorchDecoderOps) -> torch.Tensor:
        """The fused q/k/v projection of ``h`` [T, q_size + 2 * kv_size], before RoPE
        (families that normalise q and k heads override it)."""
        del ops  # llama's projection needs no element-wise op
        return self.qkv(h)

    def attend(
        self,
        h: torch.Tensor,
        rope: RopeRows,
        kv_cache: LayerCache,
        attention: PagedAttention,
        ops: TorchDecoderOps,
    ) -> torch.Tensor:
        """Attention of the normed stream ``h`` [T, hidden] -> [T, heads * head_dim], before
        o_proj. Stores this step's K/V in ``kv_cache``."""
        # RoPE on q and k, and this step's K/V stored in the cache.
        q = ops.rope_write_kv(self.project_qkv(h, ops), rope, kv_cache, attention)
        # Attention reads K/V back from the cache (including this step's): chunked prefill,
        # whole prefill and decode then see exactly the same keys.
        return attention(q, kv_cache[0], kv_cache[1], window=self.attention_window)

    def feed_forward(
        self, x: torch.Tensor, h: torch.Tensor, ops: TorchDecoderOps
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MLP of the normed stream ``h``, added to the residual ``x`` (as ``_residual``
        returns it)."""
        return self._residual(x, self.down, ops.silu_and_mul(self.gate_up(h)))

    def _norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        ops: TorchDecoderOps,
    ) -> torch.Tensor:
        """RMSNorm of x, after adding the pending ``delta`` to it in place."""
        if delta is None:
            return ops.rms_norm(x, weight, self.eps)
        return ops.add_rms_norm(x, delta, weight, self.eps)

    @staticmethod
    def _residual(
        residual: torch.Tensor, linear: LinearLike, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual + linear(x), None), fused into the matmul when the dtypes agree; else
        (residual, linear(x)): the add is left to the next norm."""
        if residual.dtype == x.dtype:
            return linear.add_to(residual, x), None
        return residual, linear(x)
