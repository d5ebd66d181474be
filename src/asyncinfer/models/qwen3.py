"""Qwen3 decoder: Llama's block with a per-head RMSNorm of q and k before rope, and its registry entry.

Qwen3 differs from Qwen2 in its attention only: the q/k/v projections carry no bias, the head size is
stated by the config (``head_dim``, so ``num_heads * head_dim`` need not equal ``hidden_size``), and
each query and key head is RMS-normalised over its ``head_dim`` values (``q_norm``, ``k_norm``: one
weight vector each, shared by all heads of a layer) before it is rotated. Everything else (pre-norm
blocks, SwiGLU, untied or tied head, rotate_half rope) is :class:`~asyncinfer.models.llama.LlamaForCausalLM`'s.

Parameter names beyond Llama's (what ``QWEN3_WEIGHT_MAP`` fills)::

    layers.{i}.attn.q_norm.weight               [head_dim]
    layers.{i}.attn.k_norm.weight               [head_dim]

Checkpoints: Hugging Face ``Qwen3ForCausalLM`` (``model_type`` "qwen3") and GGUF files of llama.cpp's
``qwen3`` architecture (``blk.{i}.attn_q_norm`` / ``attn_k_norm``; q/k rows not permuted).

In a block format a Qwen3 model decodes in the kernels' one-call decode step like Llama
(:class:`asyncinfer.models.decode_backends.KernelDecode`): the kernels' decoder layer normalises each q and
k head with these weights (:meth:`Qwen3Attention.kernel_qk_norms`) between the projection and rope.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from asyncinfer.models.attention import AttentionMetadata
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.layers import EAGER_OPS, ElementwiseOps, RMSNorm
from asyncinfer.models.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from asyncinfer.models.registry import ModelFamily, WeightMap, register_model_family


class Qwen3Attention(LlamaAttention):
    """:class:`LlamaAttention` with each query and key head RMS-normalised (``q_norm``, ``k_norm``) before rope."""


    def __init__(self, config: ModelConfig, ops: ElementwiseOps = EAGER_OPS, window: int | None = None) -> None:
        super().__init__(config, ops, window)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops.rms_norm)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops.rms_norm)

    def kernel_qk_norms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``q_norm`` and ``k_norm``'s weights: the kernels' decode layer normalises every head with them."""
        return self.q_norm.weight, self.k_norm.weight

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = qkv[:, self.q_size : qk_size].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q = self._rope(self.q_norm(q), cos, sin)  # [T, H, D]: normalised over D, then rotated
        k = self._rope(self.k_norm(k), cos, sin)  # [T, KVH, D]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, **self._attn_kwargs)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block around :class:`Qwen3Attention`."""

    attention_class: ClassVar[type[LlamaAttention]] = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Decoder for Qwen3 configs: :class:`LlamaForCausalLM` stacking :class:`Qwen3DecoderLayer`."""

    decoder_layer_class: ClassVar[type[LlamaDecoderLayer]] = Qwen3DecoderLayer


# (HF checkpoint name, GGUF tensor name, parameter name, fused shard or None); q/k/v and gate/up land in
# row blocks of the fused projections, as for Llama.
QWEN3_WEIGHT_MAP: WeightMap = (
    ("model.embed_tokens.weight", "token_embd.weight", "embed_tokens.weight", None),
    ("model.norm.weight", "output_norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", "lm_head.weight", None),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "layers.{i}.input_norm.weight", None),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", "layers.{i}.attn.qkv_proj.weight", "q"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", "layers.{i}.attn.qkv_proj.weight", "k"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", "layers.{i}.attn.qkv_proj.weight", "v"),
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", "layers.{i}.attn.q_norm.weight", None),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", "layers.{i}.attn.k_norm.weight", None),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "layers.{i}.attn.o_proj.weight", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", "layers.{i}.post_attn_norm.weight", None),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", "layers.{i}.mlp.gate_up_proj.weight", "gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", "layers.{i}.mlp.gate_up_proj.weight", "up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", "layers.{i}.mlp.down_proj.weight", None),
)

# llama.cpp's converter leaves Qwen3's q/k rows as they are (its rope for qwen3 is rotate_half's, "neox").
register_model_family(ModelFamily("qwen3", Qwen3ForCausalLM, QWEN3_WEIGHT_MAP, ("Qwen3ForCausalLM",), gguf=True))
