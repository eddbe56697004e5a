"""Rotary position embeddings (RoPE) in the "rotate half" layout of Hugging Face llama.

The cos/sin tables cover every position up to ``max_position_embeddings`` and are built once,
so a forward pass only gathers the rows of its positions (one index_select each, shared by all
layers). They are computed in float32 exactly as transformers does and then cast to the model
dtype, so the rotated q/k match transformers bit for bit in float32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .architecture import ModelArchConfig

#: A step's rows of the rotary tables, ``(cos, sin_signed)`` at its positions, ``[T, D]`` each
#: (see :meth:`RotaryTables.lookup`).
RopeRows = tuple[torch.Tensor, torch.Tensor]


def rope_inv_freq(config: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (float32) for the config's rope type."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths are divided by ``factor``, short ones are
    kept, and the band between is interpolated (same formula as transformers)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryTables:
    """Precomputed ``cos`` and sign-folded ``sin`` tables, [max_positions, head_dim] each.

    transformers rotates with ``x * cos + rotate_half(x) * sin`` where
    ``rotate_half(x) = cat(-x2, x1)``. We store ``sin`` with its first half negated, so the
    rotation becomes ``x * cos + swap_halves(x) * sin_signed``: a flip of a [2, D/2] view
    replaces transformers' slice/neg/cat (fewer ops per layer, same products).
    """

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = config.head_dim // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin_signed = sin.to(device=device, dtype=dtype)
        self.max_positions = config.max_position_embeddings

    def lookup(self, positions: torch.Tensor) -> RopeRows:
        """cos and signed sin rows [T, head_dim] for ``positions`` [T]. Done once per forward
        and shared by all layers."""
        return self.cos.index_select(0, positions), self.sin_signed.index_select(0, positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (may be a strided view); returns a new contiguous
    tensor. Three kernels: flip (the half swap), mul, addcmul_."""
    t, heads, dim = x.shape
    swapped = x.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)
    out = x * cos
    return out.addcmul_(swapped, sin_signed)
