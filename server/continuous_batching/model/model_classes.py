"""Which model class runs each family (``ModelArchConfig.family`` -> causal LM class).

Families absent here run ``LlamaForCausalLM``; a family whose model-level steps differ
(embedding scale, rope per layer, logit soft-capping: Gemma) subclasses it and adds a line.
"""

from __future__ import annotations

from .architecture import ModelArchConfig
from .gemma import GEMMA_FAMILIES, GemmaForCausalLM
from .llama import LlamaForCausalLM

#: family -> model class.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **dict.fromkeys(GEMMA_FAMILIES, GemmaForCausalLM),
}


def model_class_for(config: ModelArchConfig) -> type[LlamaForCausalLM]:
    """The causal LM class of the config's family."""
    return MODEL_CLASSES.get(config.family, LlamaForCausalLM)
