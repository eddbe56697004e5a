"""Model code of the engine (torch, paged KV cache): the families it runs and their loaders."""

from .architecture import ModelArchConfig, UnsupportedModelError
from .attention import AttentionGroup, AttentionMetadata, build_attention_metadata
from .families import SUPPORTED_ARCHITECTURES, read_hf_config
from .llama import LlamaForCausalLM, kv_bytes_per_block, kv_cache_shape

__all__ = [
    "AttentionGroup",
    "AttentionMetadata",
    "SUPPORTED_ARCHITECTURES",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "UnsupportedModelError",
    "build_attention_metadata",
    "kv_bytes_per_block",
    "kv_cache_shape",
    "read_hf_config",
]
