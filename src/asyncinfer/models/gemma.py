"""Gemma 2 and Gemma 3 (text) decoders over a flattened, paged batch, and their registry entries.

Both are a Llama-shaped decoder with Gemma's differences, each matching transformers'
``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``:

- the embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the dtype of the embedding's rows, the
  model's, as transformers does; float32 for an embedding kept in its GGUF file's blocks);
- RMSNorm multiplies by ``norm_weight_offset + weight`` in float32 (``ModelConfig.norm_weight_offset``:
  1.0 for Hugging Face checkpoints, which store ``weight - 1``; 0.0 for llama.cpp's GGUFs, whose
  converter stored ``weight + 1``), and every layer has four of them: before and after attention, before
  and after the MLP (``x + post(attn(pre(x)))``, then the same around the MLP);
- the MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``;
- the softmax scale is ``query_pre_attn_scalar ** -0.5``;
- layers alternate between a sliding window and full attention (``ModelConfig.layer_types``);
- Gemma 2 soft-caps the attention scores and the final logits (``cap * tanh(x / cap)``);
- Gemma 3 normalises q and k per head (RMSNorm over ``head_dim``, before rope) and gives its sliding
  layers their own rope base (``ModelConfig.sliding_rope_theta``, no rope scaling), its full layers the
  config's ``rope_theta`` and ``rope_scaling``. As in transformers, Gemma 3 has no attention soft-capping
  (a config's ``attn_logit_softcapping`` is not applied); its final soft-capping applies where set.

Parameter names (what the weight maps fill)::

    embed_tokens.weight                         [vocab, hidden]
    layers.{i}.input_norm.weight                [hidden]
    layers.{i}.attn.qkv_proj.weight             [q_size + 2 * kv_size, hidden]  rows: [q; k; v]
    layers.{i}.attn.q_norm.weight               [head_dim]                      (gemma3 only)
    layers.{i}.attn.k_norm.weight               [head_dim]                      (gemma3 only)
    layers.{i}.attn.o_proj.weight               [hidden, q_size]
    layers.{i}.post_attn_norm.weight            [hidden]
    layers.{i}.pre_mlp_norm.weight              [hidden]
    layers.{i}.mlp.gate_up_proj.weight          [2 * intermediate, hidden]      rows: [gate; up]
    layers.{i}.mlp.down_proj.weight             [hidden, intermediate]
    layers.{i}.post_mlp_norm.weight             [hidden]
    norm.weight                                 [hidden]
    lm_head.weight                              [vocab, hidden]                 (untied only)

Under ``torch_compile=True`` the rotary function is the compiled one; Gemma's norm and GeGLU run eagerly.
In the block formats (every projection and the head in ggml's blocks) a step of decodes runs as one kernel call
(:class:`asyncinfer.models.decode_backends.KernelDecode`), whose layer takes each of Gemma's parts above (a sliding
layer's window included) as a per-layer parameter chosen at load; any other step (a prefill, a mixed step) runs this
module's forward. Every other weight format decodes through :class:`~asyncinfer.models.decode_backends.TorchDecode`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from asyncinfer.models.attention import AttentionMetadata
from asyncinfer.models.config import SLIDING_ATTENTION, ModelConfig
from asyncinfer.models.layers import EAGER_OPS, ElementwiseOps, RotaryEmbedding, SwiGLUMLP
from asyncinfer.models.registry import ModelFamily, WeightMap, register_model_family

KVCache = tuple[torch.Tensor, torch.Tensor]


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Gemma's RMSNorm of x [..., dim]: normalised and multiplied by ``offset + weight`` in float32, in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [..., dim]
    return (x32 * (offset + weight.float())).to(x.dtype)  # [..., dim]


def gelu_tanh_mul(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """GeGLU's activation: ``gelu_tanh(gate) * up`` for gate_up [T, 2 * I] (rows [gate; up]) -> [T, I]. The
    product is taken in place in the gelu's new tensor: one new [T, I] tensor, not two (each costs its page
    faults in a long prefill chunk; see :func:`asyncinfer.models.layers.silu_mul`)."""
    gate, up = gate_up.split(intermediate_size, dim=-1)  # [T, I] each
    return F.gelu(gate, approximate="tanh").mul_(up)


class GemmaRMSNorm(nn.Module):
    """:func:`gemma_rms_norm` with its weight (as the checkpoint stores it) and the config's offset."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, self.weight, self.eps, self.offset)  # [..., dim]

    def kernel_weight(self) -> torch.Tensor:
        """What the normalised values are multiplied by, float32 [dim]: ``offset + weight`` computed as
        :func:`gemma_rms_norm` computes it (bit for bit), for the kernels' RMS norm, which takes one weight."""
        with torch.no_grad():
            return (self.offset + self.weight.detach().float()).contiguous()


class GemmaAttention(nn.Module):
    """GQA self-attention with one fused q/k/v projection, optional per-head q/k norms, the layer's
    window and soft-cap handed to the step's attention backend (``meta.backend``)."""

    def __init__(self, config: ModelConfig, ops: ElementwiseOps, layer: int, *, qk_norm: bool,
                 softcap: float | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.softcap = softcap
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        offset = config.norm_weight_offset
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, offset) if qk_norm else None
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, offset) if qk_norm else None
        self._rope = ops.apply_rope
        # The backend's keyword arguments for this layer: its window and soft-cap, where it has them.
        self._attn_kwargs: dict[str, float] = {}
        if self.window is not None:
            self._attn_kwargs["window"] = self.window
        if softcap is not None:
            self._attn_kwargs["softcap"] = softcap

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)  # [T, H, D], [T, KVH, D]
        out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, **self._attn_kwargs)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [T, hidden]


class GemmaDecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``+ post_mlp_norm(mlp(pre_mlp_norm(.)))``."""

    def __init__(self, config: ModelConfig, ops: ElementwiseOps, layer: int, *, qk_norm: bool,
                 softcap: float | None) -> None:
        super().__init__()
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_weight_offset
        self.input_norm = GemmaRMSNorm(hidden, eps, offset)
        self.attn = GemmaAttention(config, ops, layer, qk_norm=qk_norm, softcap=softcap)
        self.post_attn_norm = GemmaRMSNorm(hidden, eps, offset)
        self.pre_mlp_norm = GemmaRMSNorm(hidden, eps, offset)
        self.mlp = SwiGLUMLP(hidden, config.intermediate_size, gelu_tanh_mul)  # the same fused layout, GeGLU
        self.post_mlp_norm = GemmaRMSNorm(hidden, eps, offset)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.input_norm(x), cos, sin, kv_cache, meta))  # [T, hidden]
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))  # [T, hidden]


class GemmaForCausalLM(nn.Module):
    """The Gemma 2 decoder (and, with :class:`Gemma3ForCausalLM`'s two switches, Gemma 3's).

    The model family contract of :mod:`asyncinfer.models.registry`: ``forward`` returns final-normed
    hidden states for every token, ``compute_logits`` projects the rows the caller samples from (and
    soft-caps them where the config says), ``lm_head_weight`` / ``use_output_proj`` / ``output_proj``
    for the weight formats.
    """

    #: Per-head q/k RMSNorms before rope (Gemma 3).
    qk_norm: ClassVar[bool] = False
    #: Whether ``attn_logit_softcapping`` caps the attention scores (Gemma 2; transformers' Gemma 3 ignores it).
    attn_softcap_applies: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, ops: ElementwiseOps = EAGER_OPS) -> None:
        super().__init__()
        self.config = config
        self._ops = ops
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's sliding layers: their own rope base, no scaling (None: every layer uses self.rotary).
        self.local_rotary = (None if config.sliding_rope_theta is None else
                             RotaryEmbedding(replace(config, rope_theta=config.sliding_rope_theta, rope_scaling=None)))
        types = config.layer_types or ()
        self._local_layers = tuple(self.local_rotary is not None and i < len(types) and types[i] == SLIDING_ATTENTION
                                   for i in range(config.num_layers))
        softcap = config.attn_logit_softcapping if self.attn_softcap_applies else None
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ops, i, qk_norm=self.qk_norm, softcap=softcap)
                                    for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The weight format's output projection (see use_output_proj); None: lm_head_weight in the dtype.
        self.output_proj: nn.Module | None = None
        # sqrt(hidden) as each float dtype rounds it, for the embedding rows of that dtype (init_buffers: a
        # dtype's rounding is computed off the meta device). A float table's rows are in the model's dtype, a
        # block embedding's (models.quant.BlockEmbedding) in float32.
        self._embed_scales: dict[torch.dtype, float] = {}

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
        h = h * self._embed_scales[h.dtype]
        full = self.rotary.cos_sin(positions, h.dtype)  # ([T, 1, D/2], [T, 1, D/2])
        local = full if self.local_rotary is None else self.local_rotary.cos_sin(positions, h.dtype)
        for layer, kv_cache, is_local in zip(self.layers, kv_caches, self._local_layers):
            cos, sin = local if is_local else full
            h = layer(h, cos, sin, kv_cache, meta)  # [T, hidden]
        return self.norm(h)  # [T, hidden]

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """One bool a layer: whether it rotates with :attr:`local_rotary`'s tables (Gemma 3's sliding layers),
        not :attr:`rotary`'s."""
        return self._local_layers

    def embed_scale(self, dtype: torch.dtype) -> float:
        """What the embedding rows of ``dtype`` (float32, float16 or bfloat16) are multiplied by: ``sqrt(hidden)``
        as ``dtype`` rounds it (after :meth:`init_buffers`)."""
        return self._embed_scales[dtype]

    @property
    def ops(self) -> ElementwiseOps:
        """The element-wise functions this model was built with."""
        return self._ops

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the rope tables (non-persistent buffers, never in checkpoints) on ``device``, and the
        embedding scale as each float dtype of the embedding's rows rounds it."""
        self.rotary.materialize(device)
        if self.local_rotary is not None:
            self.local_rotary.materialize(device)
        scale = torch.tensor(self.config.hidden_size**0.5, device="cpu")
        self._embed_scales = {dtype: float(scale.to(dtype)) for dtype in (torch.float32, torch.float16,
                                                                          torch.bfloat16)}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The output projection [vocab, hidden] (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_output_proj(self, proj: nn.Module) -> None:
        """Compute logits with ``proj`` from now on (the output projection in a weight format); an untied
        float head is dropped, a tied one stays as the embedding used for lookups."""
        self.output_proj = proj
        if not self.config.tie_word_embeddings:
            self.lm_head = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states [N, hidden] to float32 logits [N, vocab], soft-capped where the config says."""
        if self.output_proj is not None:
            logits = self.output_proj(hidden).float()  # [N, vocab]
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()  # [N, vocab]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForCausalLM(GemmaForCausalLM):
    """The Gemma 3 text decoder: :class:`GemmaForCausalLM` with per-head q/k norms and no attention soft-capping."""

    qk_norm = True
    attn_softcap_applies = False


# (HF checkpoint name, GGUF tensor name, parameter name, fused shard or None); "{i}" is the layer index.
# llama.cpp's names: gguf's MODEL_TENSOR ATTN_POST_NORM ("post_attention_norm"), FFN_PRE_NORM ("ffn_norm"),
# FFN_POST_NORM ("post_ffw_norm"), ATTN_Q_NORM / ATTN_K_NORM ("attn_q_norm" / "attn_k_norm").
GEMMA2_WEIGHT_MAP: WeightMap = (
    ("model.embed_tokens.weight", "token_embd.weight", "embed_tokens.weight", None),
    ("model.norm.weight", "output_norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", "lm_head.weight", None),
    ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight", "layers.{i}.input_norm.weight", None),
    ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight", "layers.{i}.attn.qkv_proj.weight", "q"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight", "layers.{i}.attn.qkv_proj.weight", "k"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight", "layers.{i}.attn.qkv_proj.weight", "v"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight", "layers.{i}.attn.o_proj.weight", None),
    ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.post_attention_norm.weight",
     "layers.{i}.post_attn_norm.weight", None),
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "blk.{i}.ffn_norm.weight", "layers.{i}.pre_mlp_norm.weight",
     None),
    ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight", "layers.{i}.mlp.gate_up_proj.weight", "gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight", "layers.{i}.mlp.gate_up_proj.weight", "up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight", "layers.{i}.mlp.down_proj.weight", None),
    ("model.layers.{i}.post_feedforward_layernorm.weight", "blk.{i}.post_ffw_norm.weight",
     "layers.{i}.post_mlp_norm.weight", None),
)
GEMMA3_WEIGHT_MAP: WeightMap = (
    *GEMMA2_WEIGHT_MAP,
    ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight", "layers.{i}.attn.q_norm.weight", None),
    ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight", "layers.{i}.attn.k_norm.weight", None),
)

register_model_family(ModelFamily("gemma2", GemmaForCausalLM, GEMMA2_WEIGHT_MAP, ("Gemma2ForCausalLM",), gguf=True,
                                  hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0,
                                  gguf_eot_tokens=("<end_of_turn>",)))
# The family takes GGUF's name ("gemma3"); transformers names the text model's config "gemma3_text".
register_model_family(ModelFamily("gemma3", Gemma3ForCausalLM, GEMMA3_WEIGHT_MAP, ("Gemma3ForCausalLM", "gemma3_text"),
                                  gguf=True, hidden_act="gelu_pytorch_tanh", norm_weight_offset=1.0,
                                  gguf_eot_tokens=("<end_of_turn>",)))
