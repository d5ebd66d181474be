"""The from-scratch model runner layer: config, attention backends, Llama-family model, loader."""

from asyncinfer.models.attention import AttentionBackend, AttentionMetadata, select_attention_backend
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.loader import LoadedModel, load_model

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "load_model",
    "select_attention_backend",
]
