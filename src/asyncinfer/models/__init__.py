"""The from-scratch model layer: config, attention backends, model families (Llama/Qwen2/Mistral/Qwen3/Phi-3), loaders."""

from asyncinfer.models.attention import AttentionBackend, AttentionMetadata, select_attention_backend
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.loader import LoadedModel, load_model
from asyncinfer.models.registry import ModelFamily, model_family, register_model_family

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "ModelFamily",
    "load_model",
    "model_family",
    "register_model_family",
    "select_attention_backend",
]
