"""Model families: the one list of the decoder architectures asyncinfer runs.

A :class:`ModelFamily` maps an architecture name (``ModelConfig.architecture``:
the Hugging Face ``model_type``, also GGUF's ``general.architecture`` where the
family loads from GGUF) and its Hugging Face class names (config.json's
``architectures``, e.g. ``"Qwen2ForCausalLM"``) to the model class that runs it,
the weight map that fills that class from a checkpoint, and the few
per-architecture facts that config normalisation and the loaders need.

A family lives in one module that defines its model class and weight map and
calls :func:`register_model_family` at import. The built-in modules are listed
in ``_BUILTIN_MODULES`` and imported on the first lookup; a family from another
package registers when its module is imported (before the engine loads a model).

The model class contract (what the loader, the runner and ``quant.py`` use):

- ``model_class(config: ModelConfig, ops: ElementwiseOps = EAGER_OPS)`` builds the model
  with the element-wise functions its layers compute with (:class:`asyncinfer.models.layers.ElementwiseOps`:
  the eager ones, or their compiled forms with ``torch_compile=True``), fixed for its life; the loader
  builds it on the meta device and assigns the checkpoint's tensors to its parameters. It keeps
  ``config`` (the :class:`ModelConfig`) as an attribute;
- ``init_buffers(device)`` computes the buffers that are not in checkpoints
  (rope tables) on the target device;
- ``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden]``,
  where ``kv_caches`` holds one ``(k_cache, v_cache)`` per layer and attention
  runs through ``meta.backend`` (see :mod:`asyncinfer.models.attention`);
- ``compute_logits(hidden [N, hidden]) -> float32 logits [N, vocab]``;
- its output projection, for the weight formats (``quant.py``): ``lm_head_weight`` [vocab, hidden]
  (the embedding when ``config.tie_word_embeddings``), ``use_output_proj(layer)`` (compute logits
  with the format's layer from now on) and ``output_proj`` (that layer, or None);
- its token embedding, an ``nn.Embedding`` that it only calls (``embedding(input_ids)``): a GGUF file
  loaded in a block format puts a ``quant.BlockEmbedding`` there instead (float32 rows from the file's
  blocks, no ``weight``), so a family reads no embedding weight after load (a tied ``lm_head_weight``
  then goes unused: the head is in a format of its own, ``output_proj``).

The weight map: rows ``(HF checkpoint name, GGUF tensor name, parameter name,
fused shard or None)``; ``"{i}"`` is the layer index, and a shard (``"q"``,
``"k"``, ``"v"``, ``"gate"``, ``"up"``) names the row block of a fused parameter.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncinfer.errors import InvalidParameterError, ModelLoadError

if TYPE_CHECKING:
    from torch import nn

WeightMap = tuple[tuple[str, str, str, str | None], ...]

# Modules that define and register the built-in families, imported on first lookup.
_BUILTIN_MODULES = ("asyncinfer.models.llama", "asyncinfer.models.qwen3", "asyncinfer.models.phi3",
                    "asyncinfer.models.gemma")
#: The built-in families as listed (docs, errors), whichever of their modules was imported first.
_BUILTIN_ORDER = ("llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3")
_FAMILIES: dict[str, ModelFamily] = {}  # family name -> family
_NAMES: dict[str, ModelFamily] = {}  # family name or HF class name -> family


@dataclass(frozen=True)
class ModelFamily:
    """One decoder architecture: its model class, weight map and loading quirks.

    - ``name``: ``ModelConfig.architecture`` (the HF ``model_type``; GGUF's
      ``general.architecture`` too when ``gguf``);
    - ``hf_architectures``: config.json ``architectures`` names that select it;
    - ``gguf``: it loads from GGUF files;
    - ``qkv_bias``: its q/k/v projections always carry a bias (Qwen2); otherwise a
      config asking for attention bias is refused;
    - ``sliding_window``: its window always applies (Mistral, Phi-3); otherwise only when
      the config sets ``use_sliding_window`` or names ``sliding_attention`` layers in
      ``layer_types`` (Qwen2, Gemma). Attention then sees the last ``sliding_window``
      keys on those layers (``ModelConfig.layer_window``); the context stays the model's;
    - ``gguf_permuted_qk``: llama.cpp's converter permuted its q/k rows (undone at load);
    - ``hidden_act``: the MLP activation its configs must name (``"silu"``: SwiGLU;
      ``"gelu_pytorch_tanh"``: Gemma's GeGLU); a config naming another is refused;
    - ``norm_weight_offset``: what its RMSNorms add to the norm weights of a Hugging Face checkpoint
      (Gemma: 1.0, its checkpoints store ``weight - 1``; a GGUF file's are taken as they are, llama.cpp's
      converter having added it);
    - ``gguf_eot_tokens``: texts of the tokens that end a chat turn (Gemma's
      ``<end_of_turn>``), added to a GGUF file's end-of-sequence ids where its vocabulary has them.
    """

    name: str
    model_class: type[nn.Module]
    weight_map: WeightMap
    hf_architectures: tuple[str, ...] = ()
    gguf: bool = False
    qkv_bias: bool = False
    sliding_window: bool = False
    gguf_permuted_qk: bool = False
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    gguf_eot_tokens: tuple[str, ...] = ()


def register_model_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` loadable under its name and its HF class names, in this process.

    Raises:
        InvalidParameterError: one of its names already belongs to another family.
    """
    for name in (family.name, *family.hf_architectures):
        other = _NAMES.get(name)
        if other is not None and other != family:
            raise InvalidParameterError("architecture", name, f"a name not registered yet (it is {other.name}'s)")
    _FAMILIES[family.name] = family
    _NAMES.update(dict.fromkeys((family.name, *family.hf_architectures), family))
    return family


def supported_architectures(*, gguf: bool = False) -> tuple[str, ...]:
    """The family names, the built-in ones in ``_BUILTIN_ORDER`` whichever module was imported
    first, then the others in registration order (only those loading from GGUF with ``gguf``)."""
    _import_builtins()

    def rank(family: ModelFamily) -> int:
        return _BUILTIN_ORDER.index(family.name) if family.name in _BUILTIN_ORDER else len(_BUILTIN_ORDER)

    families = sorted(_FAMILIES.values(), key=rank)  # stable: registration order within a module
    return tuple(family.name for family in families if family.gguf or not gguf)


def find_model_family(name: str | None) -> ModelFamily | None:
    """The family registered under ``name`` (a family or HF class name), or None."""
    _import_builtins()
    return _NAMES.get(name) if isinstance(name, str) else None


def model_family(name: str | None, *, what: str = "architecture", gguf: bool = False) -> ModelFamily:
    """The family registered under ``name``; with ``gguf``, only one that loads from GGUF.

    Raises:
        ModelLoadError: no such family, saying ``unsupported {what} {name!r}`` and listing the supported ones.
    """
    family = find_model_family(name)
    if family is None or (gguf and not family.gguf):
        supported = ", ".join(supported_architectures(gguf=gguf))
        raise ModelLoadError(f"unsupported {what} {name!r}; supported: {supported}")
    return family


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)  # registers at first import; a dict lookup after that
