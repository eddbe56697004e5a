"""Which decoder block each model family runs (``ModelArchConfig.family`` -> block class).

A family whose block differs from llama's adds its own module with a ``LlamaDecoderLayer``
subclass and one line here; its config reader (``families``) sets ``family``.
"""

from __future__ import annotations

from .architecture import ModelArchConfig
from .decoder_layer import LlamaDecoderLayer
from .gemma_layer import GEMMA_FAMILIES, GemmaDecoderLayer
from .moe_layers import MoeDecoderLayer, Qwen3MoeDecoderLayer, Qwen3MoeDenseDecoderLayer
from .phi3 import Phi3DecoderLayer
from .qwen3 import Qwen3DecoderLayer

#: family -> block class. Families absent here run the llama block unchanged.
LAYER_CLASSES: dict[str, type[LlamaDecoderLayer]] = {
    "llama": LlamaDecoderLayer,
    **dict.fromkeys(GEMMA_FAMILIES, GemmaDecoderLayer),
    "qwen3": Qwen3DecoderLayer,
    "phi3": Phi3DecoderLayer,
    "mixtral": MoeDecoderLayer,
    "qwen3_moe": Qwen3MoeDecoderLayer,
}

#: family -> the block of its layers without experts (``ModelArchConfig.is_moe_layer``).
DENSE_LAYER_CLASSES: dict[str, type[LlamaDecoderLayer]] = {
    "qwen3_moe": Qwen3MoeDenseDecoderLayer,
}


def layer_class_for(config: ModelArchConfig, layer_index: int) -> type[LlamaDecoderLayer]:
    """The block class of layer ``layer_index`` (a family may mix kinds, e.g. dense and
    mixture-of-experts layers)."""
    if config.family in DENSE_LAYER_CLASSES and not config.is_moe_layer(layer_index):
        return DENSE_LAYER_CLASSES[config.family]
    return LAYER_CLASSES.get(config.family, LlamaDecoderLayer)
