"""Phi-3: Llama's network, stored with its projections already fused; its weight map and registry entry.

A Phi-3 decoder computes what :class:`~asyncinfer.models.llama.LlamaForCausalLM` computes (pre-norm
blocks, GQA attention with rotate_half rope, SwiGLU, an untied head), and its checkpoints hold the two
projections that class fuses as single tensors: ``qkv_proj`` (rows ``[q; k; v]``) and ``gate_up_proj``
(rows ``[gate; up]``). Each fills its parameter whole, so the weight map has no shards.

Checkpoints: Hugging Face ``Phi3ForCausalLM`` (``model_type`` "phi3") and GGUF files of llama.cpp's
``phi3`` architecture (``blk.{i}.attn_qkv``, and ``blk.{i}.ffn_up`` holding gate and up; q/k rows not
permuted). Plain rope, or longrope ("su": Phi-3-mini-128k, Phi-3.5-mini; in a GGUF file, the
``rope_factors_short`` / ``rope_factors_long`` tensors): its short and long factors are in the rope tables, and
which a token reads is :class:`asyncinfer.models.layers.RopeRows`' (a request past the original context is
computed again on the long factors, as transformers' Phi-3 ``generate()`` does; docs/models_and_embeddings.md).
The window of a config's ``sliding_window`` always applies (the family's ``sliding_window``): every layer
attends within it, at the model's full context. The kernels' one-call decode step runs Phi-3 as it runs
Llama (its window the kernels' layer's, past the window too).
"""

from __future__ import annotations

from asyncinfer.models.llama import LlamaForCausalLM
from asyncinfer.models.registry import ModelFamily, WeightMap, register_model_family

# (HF checkpoint name, GGUF tensor name, parameter name, fused shard or None).
PHI3_WEIGHT_MAP: WeightMap = (
    ("model.embed_tokens.weight", "token_embd.weight", "embed_tokens.weight", None),
    ("model.norm.weight", "output_norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", "lm_head.weight", None),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "layers.{i}.input_norm.weight", None),
    ("model.layers.{i}.self_attn.qkv_proj.weight", "blk.{i}.attn_qkv.weight", "layers.{i}.attn.qkv_proj.weight", None),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "layers.{i}.attn.o_proj.weight", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", "layers.{i}.post_attn_norm.weight", None),
    ("model.layers.{i}.mlp.gate_up_proj.weight", "blk.{i}.ffn_up.weight", "layers.{i}.mlp.gate_up_proj.weight", None),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", "layers.{i}.mlp.down_proj.weight", None),
)

register_model_family(ModelFamily("phi3", LlamaForCausalLM, PHI3_WEIGHT_MAP, ("Phi3ForCausalLM",), gguf=True,
                                  sliding_window=True))
