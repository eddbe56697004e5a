"""Gemma 2 and Gemma 3 (text) GGUF files, as llama.cpp's ``convert_hf_to_gguf.py`` writes them
(``Gemma2Model``, ``Gemma3Model``) and llama.cpp reads them (``src/models/gemma2.cpp``,
``gemma3.cpp``): the config the Hugging Face folder's ``families.gemma`` reader would give.

What the file holds, and what llama.cpp assumes where it holds nothing:

* norms: the converter writes every ``*norm.weight`` as ``w + 1`` (Gemma's (1 + w) RMSNorm),
  so the loader marks the model's norms folded instead of adding 1 again (``weights``);
* names: ``ffn_norm`` is Gemma's pre-feed-forward norm (llama's post-attention one), and
  ``post_attention_norm`` / ``post_ffw_norm`` the norms after attention and after the MLP;
  q/k rows are not permuted (llama.cpp runs Gemma with the rotate-half "NeoX" RoPE);
* attention scale: ``query_pre_attn_scalar`` is not stored. llama.cpp scales queries by
  ``1/sqrt(head_dim)``, except for the 27B models (Gemma 2: 46 layers, Gemma 3: 62 layers),
  scaled by ``1/sqrt(hidden / heads)``, after gemma_pytorch's configs; the released
  checkpoints' ``query_pre_attn_scalar`` is exactly that, and so is ours;
* sliding layers: ``attention.sliding_window`` (Gemma 2: 4096 when absent; Gemma 3 without a
  window: every layer global) and ``attention.sliding_window_pattern`` (a per-layer bool array
  or a period; absent: 2 for Gemma 2, 6 for Gemma 3, the last layer of each period global);
* soft caps: Gemma 2 always caps, at 50 (attention) and 30 (logits) unless the file says
  otherwise; Gemma 3 caps the logits only when ``final_logit_softcapping`` is written;
* RoPE: ``rope.freq_base`` (and its scaling) is the global layers'; Gemma 3's sliding layers
  use ``rope.freq_base_swa`` (10000 when absent) unscaled; Gemma 2's sliding layers the global
  base unless ``rope.freq_base_swa`` is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .architecture import ModelArchConfig

#: GGUF architecture -> (Hugging Face architecture, model_type and family, default period of
#: the sliding-window pattern, layer count of the 27B model that llama.cpp scales differently).
GEMMA_GGUF: dict[str, tuple[str, str, int, int]] = {
    "gemma2": ("Gemma2ForCausalLM", "gemma2", 2, 46),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", 6, 62),
}

#: Per-layer GGUF names that mean something else in Gemma than in llama (keyed by our
#: ``model_type``, which ``weights_gguf.hf_name`` is given).
GEMMA_LAYER_NAMES: dict[str, str] = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

#: llama.cpp's defaults (``llama_hparams``, ``llama_model_gemma2::load_arch_hparams``).
GEMMA2_DEFAULT_WINDOW = 4096
GEMMA2_ATTN_SOFTCAP = 50.0
GEMMA2_FINAL_SOFTCAP = 30.0
SWA_ROPE_BASE = 10000.0

#: Reads ``{arch}.{key}`` of the file; the default when absent.
Meta = Callable[[str, Any], Any]


def _layer_types(meta: Meta, num_layers: int, period: int, window: int | None) -> list[str]:
    """Per layer "sliding_attention" or "full_attention", as llama.cpp's ``load_swa_pattern``
    and ``set_swa_pattern`` decide (a period of 0: every layer sliding)."""
    if window is None:
        return ["full_attention"] * num_layers
    pattern = meta("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        is_sliding = [bool(x) for x in pattern]
    else:
        n = int(pattern)
        is_sliding = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in is_sliding]


def _cap(value: Any) -> float | None:
    """A soft-capping constant, None when off (0, as llama.cpp treats it)."""
    return float(value) if value else None


def with_gguf_gemma(config: ModelArchConfig, arch: str, meta: Meta) -> ModelArchConfig:
    """``config`` (read as a llama) completed with Gemma's fields for GGUF architecture
    ``arch`` (one of ``GEMMA_GGUF``); ``meta(key, default)`` reads ``{arch}.{key}``."""
    architecture, model_type, period, layers_27b = GEMMA_GGUF[arch]
    is_gemma2 = arch == "gemma2"
    window = meta("attention.sliding_window", GEMMA2_DEFAULT_WINDOW if is_gemma2 else None)
    window = int(window) if window else None
    layer_types = _layer_types(meta, config.num_hidden_layers, period, window)
    # llama.cpp: the 27B models scale by hidden / heads, the others by head_dim.
    is_27b = config.num_hidden_layers == layers_27b
    scalar = config.hidden_size // config.num_attention_heads if is_27b else config.head_dim
    swa_base = meta("rope.freq_base_swa", None)
    if is_gemma2:
        # Sliding layers share the global rope unless the file names their own base.
        is_own_base = swa_base is not None and float(swa_base) != config.rope_theta
        sliding_theta = float(swa_base) if is_own_base else None
        sliding_scaling = config.rope_scaling if is_own_base else None
        attn_cap = _cap(meta("attn_logit_softcapping", GEMMA2_ATTN_SOFTCAP))
        final_cap = _cap(meta("final_logit_softcapping", GEMMA2_FINAL_SOFTCAP))
    else:
        has_sliding = "sliding_attention" in layer_types
        sliding_theta = float(swa_base or SWA_ROPE_BASE) if has_sliding else None
        sliding_scaling = None  # llama.cpp: rope_freq_scale_train_swa stays 1
        attn_cap, final_cap = None, _cap(meta("final_logit_softcapping", None))
    return dataclasses.replace(
        config,
        hidden_act="gelu_pytorch_tanh",
        architecture=architecture,
        model_type=model_type,
        family=model_type,
        sliding_window=window,
        layer_types=tuple(layer_types),
        attention_scale=float(scalar) ** -0.5,
        attn_logit_softcap=attn_cap,
        final_logit_softcap=final_cap,
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=sliding_scaling,
    )
