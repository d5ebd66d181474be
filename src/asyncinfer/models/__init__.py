"""The from-scratch model runner layer: config, paged attention, Llama-family model, loader."""

from asyncinfer.models.attention import AttentionMetadata, kv_cache_shape, paged_attention
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.loader import LoadedModel, load_model

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "kv_cache_shape",
    "load_model",
    "paged_attention",
]
