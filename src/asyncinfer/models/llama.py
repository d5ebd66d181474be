"""Llama-family decoder (Llama, Mistral, Qwen2) over a flattened, paged batch, and its registry entries.

This module is the whole family: the model class, ``LLAMA_WEIGHT_MAP`` (the one
table from checkpoint names, HF and GGUF spelling, to parameter names), and the
three architectures it runs, registered with :mod:`asyncinfer.models.registry`.

Parameter names (what the weight map fills)::

    embed_tokens.weight                         [vocab, hidden]                 (or its file's blocks)
    layers.{i}.input_norm.weight                [hidden]
    layers.{i}.attn.qkv_proj.weight             [q_size + 2 * kv_size, hidden]  rows: [q; k; v]
    layers.{i}.attn.qkv_proj.bias               [q_size + 2 * kv_size]          (qwen2 only)
    layers.{i}.attn.o_proj.weight               [hidden, q_size]
    layers.{i}.post_attn_norm.weight            [hidden]
    layers.{i}.mlp.gate_up_proj.weight          [2 * intermediate, hidden]      rows: [gate; up]
    layers.{i}.mlp.down_proj.weight             [hidden, intermediate]
    norm.weight                                 [hidden]
    lm_head.weight                              [vocab, hidden]                 (untied only)
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from asyncinfer.models.attention import AttentionMetadata
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.layers import EAGER_OPS, ElementwiseOps, RMSNorm, RopeFn, RotaryEmbedding, SwiGLUMLP
from asyncinfer.models.registry import ModelFamily, WeightMap, register_model_family

KVCache = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """GQA self-attention with one fused q/k/v projection and paged KV cache.

    The attention itself is the step's backend's (``meta.backend``, see
    :mod:`asyncinfer.models.attention`): this layer only projects and rotates (with ``ops.apply_rope``).
    ``window``: the layer's sliding window (:meth:`ModelConfig.layer_window`), handed to the backend.
    """

    def __init__(self, config: ModelConfig, ops: ElementwiseOps = EAGER_OPS, window: int | None = None) -> None:
        super().__init__()
        self.window = window
        # The backend's keyword arguments for this layer: its window, where it has one.
        self._attn_kwargs: dict[str, int] = {} if window is None else {"window": window}
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self._rope = ops.apply_rope

    @property
    def rope_fn(self) -> RopeFn:
        """The rotary function this layer computes with (fixed at construction)."""
        return self._rope

    def kernel_qk_norms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-head q and k norm weights the kernels' decode layer applies before rope (with the layer's
        ``eps``), or None: Llama has none (Qwen3's attention returns its ``q_norm`` / ``k_norm``)."""
        return None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        # q and k are adjacent in qkv, so one rope call rotates both.
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)  # [T, H + KVH, D]
        qk = self._rope(qk, cos, sin)  # [T, H + KVH, D]
        q = qk[:, : self.num_heads]  # [T, H, D]
        k = qk[:, self.num_heads :]  # [T, KVH, D]
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, **self._attn_kwargs)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); ``layer``: its index (for its window).

    ``attention_class``: the attention layer it builds (a family whose block differs only in its
    attention, as Qwen3's, subclasses this with its own, taking ``(config, ops, window)``).
    """

    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(self, config: ModelConfig, ops: ElementwiseOps = EAGER_OPS, layer: int = 0) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.rms_norm)
        self.attn = self.attention_class(config, ops, window=config.layer_window(layer))
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.rms_norm)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, ops.silu_mul)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, kv_cache, meta)  # [T, hidden]
        return x + self.mlp(self.post_attn_norm(x))  # [T, hidden]


class LlamaForCausalLM(nn.Module):
    """Decoder for Llama, Mistral and Qwen2 configs (Qwen2 adds q/k/v bias).

    ``forward`` returns final-normed hidden states for every token;
    ``compute_logits`` projects only the rows the caller samples from. This forward is the reference:
    every step shape and weight format runs it, and the kernels' one-call decode step
    (:class:`asyncinfer.models.decode_backends.KernelDecode`) is tested against it.

    ``ops``: the element-wise functions (RMSNorm, rotary, SwiGLU) every layer computes with, fixed here
    (the eager ones, or their compiled forms with ``torch_compile=True``).

    ``decoder_layer_class``: the block it stacks (a family that differs only inside it subclasses this
    with its own, as :class:`asyncinfer.models.qwen3.Qwen3ForCausalLM` does).
    """

    decoder_layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, ops: ElementwiseOps = EAGER_OPS) -> None:
        super().__init__()
        self.config = config
        self._ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, ops, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.rms_norm)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The weight format's output projection (see use_output_proj); None: lm_head_weight in the dtype.
        self.output_proj: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the flattened batch: input_ids/positions [T] -> hidden states [T, hidden].

        Writes this step's K/V into ``kv_caches`` (one ``(k_cache, v_cache)`` per layer).
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [T, 1, D/2] each, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv_cache, meta)  # [T, hidden]
        return self.norm(h)  # [T, hidden]

    @property
    def ops(self) -> ElementwiseOps:
        """The element-wise functions this model was built with."""
        return self._ops

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the rope tables (a non-persistent buffer, never in checkpoints) on ``device``."""
        self.rotary.materialize(device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [vocab, hidden] (the embedding matrix when tied; read while the model's layers
        are float, before a weight format: a tied embedding kept in its file's blocks has none, its head is
        ``output_proj``)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_output_proj(self, proj: nn.Module) -> None:
        """Compute logits with ``proj`` from now on: the output projection in a weight format, built by
        :func:`asyncinfer.models.quant.apply_weight_format` from :attr:`lm_head_weight`. An untied float
        head is dropped (no longer needed); a tied one stays, as the embedding used for lookups (unless the
        embedding is kept in its file's blocks, :class:`asyncinfer.models.quant.BlockEmbedding`)."""
        self.output_proj = proj
        if not self.config.tie_word_embeddings:
            self.lm_head = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states [N, hidden] to float32 logits [N, vocab]."""
        if self.output_proj is not None:
            return self.output_proj(hidden).float()  # [N, vocab]
        return F.linear(hidden, self.lm_head_weight).float()  # [N, vocab]


# (HF checkpoint name, GGUF tensor name, parameter name, fused shard or None).
# "{i}" is the layer index. A shard names the row block of the fused parameter.
LLAMA_WEIGHT_MAP: WeightMap = (
    ("model.embed_tokens.weight", "token_embd.weight", "embed_tokens.weight", None),
    ("model.norm.weight", "output_norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", "lm_head.weight", None),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "layers.{i}.input_norm.weight", None),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", "layers.{i}.attn.qkv_proj.weight", "q"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", "layers.{i}.attn.qkv_proj.weight", "k"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", "layers.{i}.attn.qkv_proj.weight", "v"),
    ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias", "layers.{i}.attn.qkv_proj.bias", "q"),
    ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias", "layers.{i}.attn.qkv_proj.bias", "k"),
    ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias", "layers.{i}.attn.qkv_proj.bias", "v"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "layers.{i}.attn.o_proj.weight", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight", "layers.{i}.post_attn_norm.weight", None),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", "layers.{i}.mlp.gate_up_proj.weight", "gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", "layers.{i}.mlp.gate_up_proj.weight", "up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", "layers.{i}.mlp.down_proj.weight", None),
)

# llama.cpp writes Mistral checkpoints as "llama" GGUFs, so "mistral" loads from HF directories only.
register_model_family(ModelFamily("llama", LlamaForCausalLM, LLAMA_WEIGHT_MAP, ("LlamaForCausalLM",),
                                  gguf=True, gguf_permuted_qk=True))
register_model_family(ModelFamily("qwen2", LlamaForCausalLM, LLAMA_WEIGHT_MAP, ("Qwen2ForCausalLM",),
                                  gguf=True, qkv_bias=True))
register_model_family(ModelFamily("mistral", LlamaForCausalLM, LLAMA_WEIGHT_MAP, ("MistralForCausalLM",),
                                  sliding_window=True))
