"""Llama-family model code of the engine (torch, paged KV cache) and its weights loaders."""

from .architecture import ModelArchConfig, UnsupportedModelError
from .attention import AttentionGroup, AttentionMetadata, build_attention_metadata
from .llama import LlamaForCausalLM, kv_bytes_per_block, kv_cache_shape

__all__ = [
    "AttentionGroup",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "UnsupportedModelError",
    "build_attention_metadata",
    "kv_bytes_per_block",
    "kv_cache_shape",
]
