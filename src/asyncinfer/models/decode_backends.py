"""Decode backends: how a loaded model runs one step, chosen once at load and held by the runner.

A step is the flattened, unpadded batch the runner prepares (:class:`StepBatch`: plain lists, decodes
first). A backend turns it into a :class:`ModelOutput`: the float32 logits of the sampled rows and,
when the step computed them, each row's argmax (the greedy tokens). Two backends, behind one contract:

- :class:`TorchDecode` — the model's own ``forward`` (the reference every backend is tested against)
  through an attention backend, then ``compute_logits`` on the sampled rows. Every weight format and
  every step shape.
- :class:`KernelDecode` — a Llama-family model (Llama, Qwen2, Mistral, Phi-3: Llama's layer exactly; Qwen3:
  Llama's layer with a per-head q/k norm before rope, which the kernels' layer applies) or a Gemma 2 / Gemma 3
  model (its four norms a layer with their weight offset, GeGLU, scaled embeddings, soft-capped scores and
  logits, Gemma 3's q/k norms and its sliding layers' own rope tables: each a parameter of the kernels' layer or
  stack, chosen at load) whose projections are all in ggml's block formats (any of
  them, per projection; a fused projection may mix them, :class:`MixedBlockLinear`) on asyncinfer's kernels:
  it builds and owns one :class:`asyncinfer.kernels.DecodeStack`
  from the model's weights, and a step of decodes, each sampled, is one ``DecodeStack.decode_packed``
  call (the step's integers in one list; logits and argmax from the same call); a sliding layer attends to
  its window there (the kernels' layer's ``window``), in every family. Any other step (a prefill, a mixed
  step, an empty one) runs the torch reference.

:func:`select_decode_backend` makes the choice (``loading.build_core`` and ``quality.py`` call it); the
attention backend goes with it: the block formats decode attention in asyncinfer's kernel
(:class:`~asyncinfer.models.attention.sdpa.KernelDecodeSdpaBackend`), everything else gets the device's
default. Nothing is attached to the model: the kernels' objects live in the backend.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
from torch import nn

from asyncinfer import kernels
from asyncinfer.models.attention import AttentionBackend, select_attention_backend
from asyncinfer.models.attention.padding import flat_padded_tables
from asyncinfer.models.attention.sdpa import KernelDecodeSdpaBackend
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.gemma import GemmaAttention, GemmaDecoderLayer, GemmaForCausalLM, GemmaRMSNorm
from asyncinfer.models.layers import RMSNorm
from asyncinfer.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from asyncinfer.models.quant import (
    BLOCK_FORMATS,
    BlockEmbedding,
    BlockLinear,
    FormatLinear,
    MixedBlockLinear,
    mixed_parts,
)
from asyncinfer.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer

KVCache = tuple[torch.Tensor, torch.Tensor]

__all__ = ["DecodeBackend", "KernelDecode", "ModelOutput", "StepBatch", "TorchDecode", "kernel_attention_applies",
           "kernel_decode_blocker", "select_decode_backend"]


@dataclass(frozen=True)
class ModelOutput:
    """One step's result: ``logits`` float32 [num_sampled, vocab] (row ``i``: the ``i``-th sampled request)
    and ``greedy_ids``, each row's argmax over all its columns when the step computed it (the kernels'
    one-call decode step), else None."""

    logits: torch.Tensor
    greedy_ids: list[int] | None = None


@dataclass
class StepBatch:
    """The flattened, unpadded token batch of one step, as Python lists (tensors are built once, if at all)."""

    input_ids: list[int]
    positions: list[int]  # each token's row of the rope tables: its position (but see models.layers.RopeRows)
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]  # flat index of the last token of every sampled request

    @property
    def sampled_decodes_only(self) -> bool:
        """Whether the step is decodes only (one token a sequence), each of them sampled, and not empty."""
        n = len(self.input_ids)
        return 0 < n == len(self.query_lens) == len(self.logits_indices)


class DecodeBackend(abc.ABC):
    """Runs a step of ``model`` over the paged KV caches; ``attention`` builds the step's metadata and
    attends in every layer. Built once per model version, at load."""

    def __init__(self, model: nn.Module, attention: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.attention = attention
        self.device = device

    @abc.abstractmethod
    def forward(self, step: StepBatch, kv_caches: list[KVCache]) -> ModelOutput:
        """Run ``step``, writing its K/V into ``kv_caches``; the logits of its sampled rows (``logits_indices``)."""


class TorchDecode(DecodeBackend):
    """The reference: the model's ``forward`` over the whole step, then ``compute_logits`` on the sampled rows."""

    def forward(self, step: StepBatch, kv_caches: list[KVCache]) -> ModelOutput:
        device = self.device
        input_ids, positions = torch.tensor([step.input_ids, step.positions], dtype=torch.long,
                                            device=device).unbind()  # [num_tokens] each: one copy from Python
        meta = self.attention.build_metadata(
            query_lens=step.query_lens,
            context_lens=step.context_lens,
            block_tables=step.block_tables,
            slot_mapping=step.slot_mapping,
            block_size=kv_caches[0][0].shape[1],  # KVCacheSpec.layer_shape: [blocks, block_size, KV heads, D]
            device=device,
        )
        model = self.model
        with torch.inference_mode():
            hidden = model(input_ids, positions, kv_caches, meta)  # [num_tokens, hidden]
            if not step.logits_indices:
                return ModelOutput(hidden.new_empty((0, model.config.vocab_size), dtype=torch.float32))
            index = torch.tensor(step.logits_indices, dtype=torch.long, device=device)
            return ModelOutput(model.compute_logits(hidden.index_select(0, index)).float())  # [num_sampled, vocab]


class KernelDecode(DecodeBackend):
    """A step of decodes in one kernel call (:meth:`asyncinfer.kernels.DecodeStack.decode_packed`); every
    other step through :class:`TorchDecode`.

    Built from a Llama-family or Gemma model whose every layer's four projections and the output projection are
    :class:`~asyncinfer.models.quant.BlockLinear` (:func:`kernel_decode_blocker` says why a model is not):
    one :class:`asyncinfer.kernels.DecodeLayer` a layer, held with the final norm and the head in
    :attr:`stack`. The kernels read the model's own weight blocks (no copy). A Gemma model's differences from
    Llama are the layers' and the stack's parameters, fixed here (see :func:`_gemma_decode_layer`).

    Raises:
        ValueError: ``model`` cannot run on the kernels (the message is :func:`kernel_decode_blocker`'s).
    """

    def __init__(self, model: nn.Module, attention: AttentionBackend, device: torch.device) -> None:
        super().__init__(model, attention, device)
        why_not = kernel_decode_blocker(model)
        if why_not is not None:
            raise ValueError(f"KernelDecode cannot run this model: {why_not}")
        assert isinstance(model, (LlamaForCausalLM, GemmaForCausalLM)) and isinstance(model.output_proj, BlockLinear)
        self._reference = TorchDecode(model, attention, device)
        head = model.output_proj.kernel_weights()
        head = (head[0], head[1], model.output_proj.out_features)
        # How every projection rounds a step's activations: one choice per model, made when it was formatted.
        act = model.output_proj.activation_dtype
        # The tables the kernel reads rows of (fixed once loaded: the loader computed the rope tables). The
        # embedding: a float32 table whose rows the kernel copies, or one kept in its file's blocks
        # (kernels.BlockTable), whose step rows the call dequantizes straight into the residual stream.
        self._embed = _embedding_table(model.embed_tokens)
        self._cos: kernels.RopeTables
        self._sin: kernels.RopeTables
        if isinstance(model, GemmaForCausalLM):
            # Gemma 3's sliding layers read the second rope table (their own base); Gemma 2 has one.
            local = model.local_layers if model.local_rotary is not None and any(model.local_layers) else ()
            layers = [_gemma_decode_layer(layer, 1 if i < len(local) and local[i] else 0, act)
                      for i, layer in enumerate(model.layers)]
            rows = torch.float32 if isinstance(self._embed, kernels.BlockTable) else self._embed.dtype
            self._stack = kernels.DecodeStack(layers, model.norm.kernel_weight(), model.norm.eps, head,
                                              embed_scale=model.embed_scale(rows),
                                              logit_softcap=model.config.final_logit_softcapping,
                                              activation_dtype=act)
            rotaries = (model.rotary,) if not local else (model.rotary, model.local_rotary)
        else:
            layers = [_decode_layer(layer, act) for layer in model.layers]
            self._stack = kernels.DecodeStack(layers, model.norm.weight, model.norm.eps, head, activation_dtype=act)
            rotaries = (model.rotary,)
        self._cos = rotaries[0].cos_cache if len(rotaries) == 1 else tuple(r.cos_cache for r in rotaries)
        self._sin = rotaries[0].sin_cache if len(rotaries) == 1 else tuple(r.sin_cache for r in rotaries)

    @property
    def stack(self) -> kernels.DecodeStack:
        """The model's layers, final norm and head as the kernels run them; its ``time_parts`` / ``timing``
        are how a profiler reads where a decode step spends its time (``benchmarks/throughput.py --profile``)."""
        return self._stack

    @property
    def embed(self) -> torch.Tensor | kernels.BlockTable:
        """The embedding table the one-call step reads its rows from: the model's float32 table, or its
        :class:`~asyncinfer.models.quant.BlockEmbedding`'s blocks (:class:`asyncinfer.kernels.BlockTable`)."""
        return self._embed

    def forward(self, step: StepBatch, kv_caches: list[KVCache]) -> ModelOutput:
        if not step.sampled_decodes_only:
            return self._reference.forward(step, kv_caches)
        # The step's integers in one list (ids, positions, slots, context lengths, block tables padded to
        # the widest): no per-step tensor or attention metadata (each torch op costs tens of microseconds
        # on a cache the step's weights have just swept).
        num_tokens = len(step.input_ids)
        width, tables = flat_padded_tables(step.block_tables)
        packed = step.input_ids + step.positions + step.slot_mapping + step.context_lens + tables
        logits, greedy = self._stack.decode_packed(packed, num_tokens, width, self._embed, self._cos, self._sin,
                                                   kv_caches)
        return ModelOutput(logits, greedy)


def _embedding_table(embedding: nn.Module) -> torch.Tensor | kernels.BlockTable:
    """The embedding as :class:`asyncinfer.kernels.DecodeStack` takes it: a :class:`BlockEmbedding`'s blocks, or
    an ``nn.Embedding``'s float table."""
    return embedding.table if isinstance(embedding, BlockEmbedding) else embedding.weight


def _decode_layer(layer: nn.Module, activation_dtype: str = "int16") -> kernels.DecodeLayer:
    """One decoder layer's weights as :class:`asyncinfer.kernels.DecodeLayer` holds them (a sliding layer's window
    too: the kernel attends to its last ``window`` keys, as the reference's window masks them); its projections
    round a step's activations as ``activation_dtype`` says (the model's :attr:`BlockLinear.activation_dtype`)."""
    attn, mlp = layer.attn, layer.mlp
    return kernels.DecodeLayer(
        norm1=layer.input_norm.weight.detach().float().contiguous(),
        norm2=layer.post_attn_norm.weight.detach().float().contiguous(),
        eps=layer.input_norm.eps,
        qkv=attn.qkv_proj.kernel_weights(), o=attn.o_proj.kernel_weights(),
        gate_up=mlp.gate_up_proj.kernel_weights(), down=mlp.down_proj.kernel_weights(),
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        intermediate_size=mlp.intermediate_size, scale=attn.scale, window=attn.window,
        activation_dtype=activation_dtype, **_qk_norms(attn.kernel_qk_norms()),
    )


def _gemma_decode_layer(layer: GemmaDecoderLayer, rope_table: int, activation_dtype: str = "int16") -> kernels.DecodeLayer:
    """A Gemma decoder layer as :class:`asyncinfer.kernels.DecodeLayer` holds it: its four norms (each weight with
    the config's offset added, :meth:`GemmaRMSNorm.kernel_weight`; ``norm2`` the pre-MLP norm), GeGLU, the
    layer's attention scale and soft-cap, Gemma 3's q/k norms, and ``rope_table``: 1 for a layer that rotates with
    the sliding layers' own tables, else 0; a sliding layer's window."""
    attn, mlp = layer.attn, layer.mlp
    qk_norms = {}
    if attn.q_norm is not None and attn.k_norm is not None:
        qk_norms = {"q_norm": attn.q_norm.kernel_weight(), "k_norm": attn.k_norm.kernel_weight()}
    return kernels.DecodeLayer(
        norm1=layer.input_norm.kernel_weight(), norm2=layer.pre_mlp_norm.kernel_weight(),
        post_norm1=layer.post_attn_norm.kernel_weight(), post_norm2=layer.post_mlp_norm.kernel_weight(),
        eps=layer.input_norm.eps,
        qkv=attn.qkv_proj.kernel_weights(), o=attn.o_proj.kernel_weights(),
        gate_up=mlp.gate_up_proj.kernel_weights(), down=mlp.down_proj.kernel_weights(),
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        intermediate_size=mlp.intermediate_size, scale=attn.scale, activation="gelu_tanh",
        attn_softcap=attn.softcap, rope_table=rope_table, window=attn.window, activation_dtype=activation_dtype,
        **qk_norms,
    )


def _qk_norms(norms: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """DecodeLayer's ``q_norm`` / ``k_norm`` arguments: none for Llama, float32 copies of Qwen3's weights."""
    if norms is None:
        return {}
    return {"q_norm": norms[0].detach().float().contiguous(), "k_norm": norms[1].detach().float().contiguous()}


def has_block_weights(model: nn.Module) -> bool:
    """Whether any of ``model``'s projections is in a block format (so asyncinfer's kernels run here)."""
    return any(isinstance(module, (BlockLinear, MixedBlockLinear)) for module in model.modules())


def kernel_attention_applies(model: nn.Module, config: ModelConfig) -> bool:
    """Whether ``model``'s decodes attend in asyncinfer's kernel (:class:`KernelDecodeSdpaBackend`): its
    projections are in a block format and its heads (``config``'s) fit the attention kernel's 8-wide vectors."""
    return config.head_dim > 0 and config.head_dim % 8 == 0 and has_block_weights(model)


#: The decoder layers the kernels' one-call decode layer computes, with the attention each must hold.
_KERNEL_LAYERS: dict[type[nn.Module], type[nn.Module]] = {
    LlamaDecoderLayer: LlamaAttention,
    Qwen3DecoderLayer: Qwen3Attention,
    GemmaDecoderLayer: GemmaAttention,
}


def _layer_norms_blocker(i: int, layer: nn.Module) -> str | None:
    """Why layer ``i``'s norms do not fit the kernels' layer (one eps for all of a layer's norms), or None."""
    if isinstance(layer, GemmaDecoderLayer):
        norms = [layer.input_norm, layer.post_attn_norm, layer.pre_mlp_norm, layer.post_mlp_norm]
        if layer.attn.q_norm is not None and layer.attn.k_norm is not None:
            norms += [layer.attn.q_norm, layer.attn.k_norm]
        if any(norm.eps != layer.input_norm.eps for norm in norms):
            return f"layers.{i}'s norms have different eps (the kernel takes one eps a layer)"
        return None
    norms = layer.attn.kernel_qk_norms()
    if norms is not None and any(norm.eps != layer.input_norm.eps for norm in (layer.attn.q_norm, layer.attn.k_norm)):
        return f"layers.{i}'s q/k norms have another eps than its input norm (the kernel takes one eps a layer)"
    return None


def _not_in_blocks(model: LlamaForCausalLM | GemmaForCausalLM, name: str, proj: nn.Module,
                   skip: tuple[str, ...] | None) -> str:
    """Why projection ``name`` of ``model`` is not in a block format: ``skip`` (the load's ``quantization_skip``;
    None where unknown) naming it, its file's format where no kernel takes it, or its input size."""
    if skip is not None and any(s and s in name for s in skip):
        return "quantization_skip names it"
    stored = dict(model.config.stored_formats).get(name)
    if stored is not None:
        parts = [part for part, _ in mixed_parts(stored)] or [stored]
        if any(part not in BLOCK_FORMATS for part in parts):
            return f"its file stores it as {'+'.join(parts)}, which no kernel takes"
    in_features = proj.in_features if isinstance(proj, (nn.Linear, FormatLinear)) else 0
    if in_features and in_features % min(size for size, _ in kernels.BLOCK_FORMATS.values()):
        return f"its input size, {in_features}, is not a whole number of blocks"
    return "quantization_skip names it" if skip is not None else "quantization_skip"


def kernel_decode_blocker(model: nn.Module, skip: tuple[str, ...] | None = None) -> str | None:
    """None when ``model`` can run steps of decodes as one kernel call (:class:`KernelDecode`), else why not.
    ``skip``: the ``quantization_skip`` it was loaded with, where known, to tell it from the other reasons a
    projection is not in a block format (its file's format, its input size)."""
    if not isinstance(model, (LlamaForCausalLM, GemmaForCausalLM)):
        return (f"{type(model).__name__} is neither a Llama-family nor a Gemma model (the kernels' decode step runs "
                "those layers only)")
    if not kernel_attention_applies(model, model.config):
        return "its projections are not in a block format, or its head_dim is not a multiple of 8"
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        if _KERNEL_LAYERS.get(type(layer)) is not type(attn):
            # A family's own block or attention: the kernels' decode layer computes Llama's (and Qwen3's q/k norms).
            return (f"layers.{i} is {type(layer).__name__} with {type(attn).__name__}, not a layer the kernels' "
                    f"decode layer computes (LlamaDecoderLayer with LlamaAttention, Qwen3DecoderLayer with "
                    f"Qwen3Attention, GemmaDecoderLayer with GemmaAttention)")
        why_not = _layer_norms_blocker(i, layer)
        if why_not is not None:
            return why_not
        projections = {"attn.qkv_proj": layer.attn.qkv_proj, "attn.o_proj": layer.attn.o_proj,
                       "mlp.gate_up_proj": layer.mlp.gate_up_proj, "mlp.down_proj": layer.mlp.down_proj}
        for name, proj in projections.items():
            if not isinstance(proj, (BlockLinear, MixedBlockLinear)):
                return (f"layers.{i}.{name} is not in a block format "
                        f"({_not_in_blocks(model, f'layers.{i}.{name}', proj, skip)})")
            if name != "attn.qkv_proj" and proj.kernel_weights()[2] is not None:
                return f"layers.{i}.{name} has a bias (the kernel adds one to q/k/v only)"
    if not isinstance(model.norm, GemmaRMSNorm if isinstance(model, GemmaForCausalLM) else RMSNorm):
        return "its final norm is not its family's RMSNorm"
    if isinstance(model, GemmaForCausalLM) and model.local_rotary is not None and (
            model.local_rotary.cos_cache.shape != model.rotary.cos_cache.shape):
        return "its sliding layers' rope tables have another number of rows than its full layers' (the kernel " \
               "reads one position a token from each)"
    head = model.output_proj
    if not isinstance(head, BlockLinear):
        return f"its output projection (lm_head) is not in a block format ({_not_in_blocks(model, 'lm_head', head, skip)})"
    if head.kernel_weights()[2] is not None:
        return "its output projection (lm_head) has a bias (the kernel adds one to q/k/v only)"
    for i, layer in enumerate(model.layers):  # the kernels' step takes one activation_dtype for the whole model
        for name, proj in (("attn.qkv_proj", layer.attn.qkv_proj), ("attn.o_proj", layer.attn.o_proj),
                           ("mlp.gate_up_proj", layer.mlp.gate_up_proj), ("mlp.down_proj", layer.mlp.down_proj)):
            if proj.activation_dtype != head.activation_dtype:
                return (f"layers.{i}.{name} rounds activations to {proj.activation_dtype}, the output projection to "
                        f"{head.activation_dtype} (the kernels' step takes one activation_dtype)")
    return None


def select_decode_backend(model: nn.Module, config: ModelConfig, device: torch.device | str) -> DecodeBackend:
    """The one choice of how ``model`` (loaded, its weight format applied; ``config`` its config) runs: :class:`KernelDecode` where
    :func:`kernel_decode_blocker` finds nothing against it, else :class:`TorchDecode`. The attention backend
    goes with it: :class:`KernelDecodeSdpaBackend` for the block formats (decode attention read in place),
    the device's default otherwise."""
    device = torch.device(device)
    attention = KernelDecodeSdpaBackend() if kernel_attention_applies(model, config) else select_attention_backend(device)
    if kernel_decode_blocker(model) is None:
        return KernelDecode(model, attention, device)
    return TorchDecode(model, attention, device)
