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

from . import rope_scaling
from .architecture import ModelArchConfig
from .rope_scaling import RopeFrequencies

#: A step's rows of the rotary tables, ``(cos, sin_signed)`` at its positions, ``[T, D]`` each
#: (see :meth:`RotaryTables.lookup`).
RopeRows = tuple[torch.Tensor, torch.Tensor]


def rope_inv_freq(config: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2] (float32) for the config's rope type (LongRoPE:
    the short ones; see ``rope_frequencies``)."""
    return rope_frequencies(config).inv_freq


def rope_frequencies(config: ModelArchConfig) -> RopeFrequencies:
    """Inverse frequencies of the rotated dimensions and their scaling, by rope type."""
    dim, base, scaling = config.rotary_dim, config.rope_theta, config.rope_scaling
    inv_freq = 1.0 / (base ** rope_scaling.base_exponents(dim))
    rope_type = scaling["rope_type"] if scaling is not None else "default"
    max_positions = config.max_position_embeddings
    if scaling is None:
        return RopeFrequencies(inv_freq)
    if rope_type == "linear":
        return RopeFrequencies(inv_freq / float(scaling["factor"]))
    if rope_type == "llama3":
        return RopeFrequencies(_llama3_inv_freq(inv_freq, scaling))
    if rope_type == "dynamic":
        return RopeFrequencies(rope_scaling.dynamic_ntk(dim, base, scaling, max_positions))
    if rope_type == "yarn":
        return RopeFrequencies(*rope_scaling.yarn(dim, base, scaling, max_positions))
    if rope_type == "longrope":
        return rope_scaling.longrope(dim, base, scaling, max_positions)
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


def _cos_sin(freqs: RopeFrequencies, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [num_positions, rotary_dim], times the attention factor (as
    transformers scales them); LongRoPE rows from ``long_from`` on use the long frequencies."""
    positions = torch.arange(num_positions, dtype=torch.int64).float()
    angles = positions[:, None] * freqs.inv_freq[None, :]
    if freqs.long_inv_freq is not None and freqs.long_from is not None:
        long_angles = positions[:, None] * freqs.long_inv_freq[None, :]
        angles[freqs.long_from :] = long_angles[freqs.long_from :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if freqs.attention_factor != 1.0:
        cos, sin = cos * freqs.attention_factor, sin * freqs.attention_factor
    return cos, sin


class RotaryTables:
    """Precomputed ``cos`` and sign-folded ``sin`` tables, [max_positions, rotary_dim] each
    (``rotary_dim`` < ``head_dim`` with a partial rotary factor: the rest is not rotated).

    transformers rotates with ``x * cos + rotate_half(x) * sin`` where
    ``rotate_half(x) = cat(-x2, x1)``. We store ``sin`` with its first half negated, so the
    rotation becomes ``x * cos + swap_halves(x) * sin_signed``: a flip of a [2, D/2] view
    replaces transformers' slice/neg/cat (fewer ops per layer, same products).
    """

    def __init__(self, config: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        cos, sin = _cos_sin(rope_frequencies(config), config.max_position_embeddings)
        half = config.rotary_dim // 2
        sin[:, :half] = -sin[:, :half]
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin_signed = sin.to(device=device, dtype=dtype)
        self.max_positions = config.max_position_embeddings

    def lookup(self, positions: torch.Tensor) -> RopeRows:
        """cos and signed sin rows [T, rotary_dim] for ``positions`` [T]. Done once per forward
        and shared by all layers."""
        return self.cos.index_select(0, positions), self.sin_signed.index_select(0, positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] (may be a strided view); returns a new contiguous
    tensor. Three kernels: flip (the half swap), mul, addcmul_."""
    dim = x.shape[-1]
    swapped = x.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)
    out = x * cos
    return out.addcmul_(swapped, sin_signed)


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """``apply_rope`` on the first ``cos.shape[-1]`` dimensions of each head of ``x``
    [T, heads, head_dim]; the rest pass through (partial rotary, as transformers' Phi-3)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, sin_signed)
    rotated = apply_rope(x[..., :rotary_dim], cos, sin_signed)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
