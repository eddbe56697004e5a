"""RoPE scaling types beyond linear and llama3: YaRN, LongRoPE (Phi-3 "su") and dynamic NTK.

Each returns the inverse frequencies of the rotated dimensions and the factor cos/sin are
multiplied by ("attention factor"), computed in float32 with the formulas of transformers'
``modeling_rope_utils`` (the tests compare against its ``ROPE_INIT_FUNCTIONS``).

Two types depend on the sequence length in transformers; here, as in vLLM, the tables are
fixed at start-up:

* dynamic NTK: transformers recomputes the base once a sequence outgrows
  ``max_position_embeddings``; vLLM (``DynamicNTKScalingRotaryEmbedding``) uses one base, the
  one for ``max_position_embeddings * factor`` positions, at every position. We do what vLLM
  does, so short sequences differ from transformers (which keeps the unscaled base there).
* LongRoPE: transformers uses the long factors for a whole forward once its last position
  reaches ``original_max_position_embeddings``; vLLM (``Phi3LongRoPEScaledRotaryEmbedding``)
  picks per position from a short and a long table. We pick per position like vLLM. Token by
  token decoding gives the same keys either way; only a prompt that crosses the boundary in
  one forward differs (transformers rotates its early tokens with the long factors too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RopeFrequencies:
    """Inverse frequencies of a RoPE table and what scales it."""

    #: [rotary_dim / 2] float32, used below ``long_from`` (at every position if that is None).
    inv_freq: torch.Tensor
    #: cos and sin are multiplied by this (YaRN, LongRoPE); 1.0 for the other types.
    attention_factor: float = 1.0
    #: LongRoPE: the frequencies from position ``long_from`` on.
    long_inv_freq: torch.Tensor | None = None
    long_from: int | None = None


def base_exponents(dim: int) -> torch.Tensor:
    """``2i / dim`` for i < dim/2, in float32 as transformers computes them."""
    return torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim


def dynamic_ntk(dim: int, base: float, scaling: dict[str, Any], max_positions: int) -> torch.Tensor:
    """Dynamic NTK fixed at ``max_positions * factor`` positions (vLLM's choice; see module)."""
    factor = float(scaling["factor"])
    seq_len = max_positions * factor
    scaled = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (scaled ** base_exponents(dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(scaling: dict[str, Any], factor: float) -> float:
    """The configured attention factor, else YaRN's ``0.1 ln(s) + 1`` (DeepSeek's mscale
    ratio when ``mscale`` and ``mscale_all_dim`` are both set)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The dimension whose wavelength turns ``num_rotations`` times over ``max_pos``."""
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn(
    dim: int, base: float, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated (divided by ``factor``) low frequencies, extrapolated (kept) high
    ones and a linear ramp between, plus the attention factor."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    low = _yarn_correction_dim(beta_fast, dim, base, original)
    high = _yarn_correction_dim(beta_slow, dim, base, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    pos_freqs = base ** base_exponents(dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, _yarn_attention_factor(scaling, factor)


def longrope(dim: int, base: float, scaling: dict[str, Any], max_positions: int) -> RopeFrequencies:
    """LongRoPE: per-dimension short and long rescale factors, the long ones from
    ``original_max_position_embeddings`` on, and the attention factor
    ``sqrt(1 + ln(s) / ln(original))`` with s = max_positions / original by default."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = base_exponents(dim)

    def inv_freq(factors: list[float]) -> torch.Tensor:
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)

    return RopeFrequencies(
        inv_freq=inv_freq(scaling["short_factor"]),
        attention_factor=float(attention_factor),
        long_inv_freq=inv_freq(scaling["long_factor"]),
        long_from=original,
    )
