"""A normalised configuration for the decoders the runner supports.

``ModelConfig`` is the only description of a model the rest of asyncinfer sees.
It is built either from a transformers ``PretrainedConfig`` (``from_hf_config``)
or from GGUF metadata (see ``loader.py``), so that the model code never has to
know which checkpoint format, or which transformers version, it came from.
Which architectures exist, and their quirks, is the registry's business
(:mod:`asyncinfer.models.registry`).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.registry import ModelFamily, find_model_family, model_family, supported_architectures

# Rope types the rotary embedding implements; "default" means no scaling.
# "freq_factors" carries explicit per-frequency divisors (GGUF's rope_freqs tensor); "longrope" (Phi-3's, "su"
# in older configs) two sets of them, short and long, chosen per request (asyncinfer.models.layers.RopeRows).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "freq_factors")
# Those a config.json may name: "freq_factors" is the GGUF reader's own (transformers has no such rope type).
HF_ROPE_TYPES = tuple(t for t in SUPPORTED_ROPE_TYPES if t != "freq_factors")
# Attention kinds a layer may have (``ModelConfig.layer_types``, Hugging Face's names).
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


#: The largest size a model's config may give (hidden_size, intermediate_size, vocab_size, layers, heads, head_dim,
#: max_position_embeddings, sliding_window): int32's largest. Shapes, the kernels' int32 indices and the memory
#: plan's byte counts are made from them; a larger one overflowed there, far from the file that said it, instead
#: of being refused when the config is read, before any weight.
MAX_CONFIG_SIZE = 2**31 - 1

#: The size keys of a Hugging Face config.json (its own names; a multimodal config's ``text_config`` too).
HF_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")


def check_config_sizes(raw: Any, keys: tuple[str, ...], where: str) -> None:
    """Refuse a size in config.json's ``raw`` dict (and its ``text_config``) past :data:`MAX_CONFIG_SIZE`, naming
    the key and ``where`` (the file), before anything is built from it. Sizes of another type are left to the
    checks that read them."""
    for part, prefix in ((raw, ""), (raw.get("text_config") if isinstance(raw, dict) else None, "text_config.")):
        if not isinstance(part, dict):
            continue
        for key in keys:
            check_config_size(prefix + key, part.get(key), where)


def check_config_size(name: str, value: object, where: str = "model config") -> None:
    """Refuse one size past :data:`MAX_CONFIG_SIZE`, naming it (``name``: its key where it was read)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_CONFIG_SIZE:
        raise ModelLoadError(f"{where}: {name} = {value} is larger than any model's (at most MAX_CONFIG_SIZE = "
                             f"{MAX_CONFIG_SIZE})")


POSITIVE_FLOAT32 = "a positive number that float32 holds (> 0, finite, at most 3.4e38)"


def positive_float32(value: object) -> bool:
    """Whether ``value`` is a real number that stays positive and finite as the float32 the model computes in: a
    soft-cap, eps or rope base of ``inf`` or ``1e300`` (a file may say so) made every logit NaN, and one below
    float32's smallest (``1e-50``) divided by zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        as_float32 = ctypes.c_float(float(value)).value
    except OverflowError:  # an int past float's range
        return False
    return 0.0 < as_float32 < math.inf


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder of a registered family (Llama, Qwen2, Mistral, Qwen3, Phi-3, Gemma 2,
    Gemma 3).

    ``architecture`` is the family's registered name (``models.registry``).
    ``rope_scaling`` is ``None`` for plain rope, else a dict with at least
    ``"rope_type"`` (one of ``"linear"``, ``"llama3"``, ``"yarn"``, ``"longrope"``, ``"freq_factors"``) and
    that type's parameters, using the Hugging Face key names (``"longrope"``: ``short_factor`` and
    ``long_factor``, ``head_dim / 2`` divisors each, ``original_max_position_embeddings``, optional ``factor``
    and ``attention_factor``).
    ``attention_bias`` means bias on the q/k/v projections only (Qwen2).

    Sliding-window attention: a query at position ``p`` of a layer with a window (:meth:`layer_window`)
    attends to the keys at positions ``p - sliding_window + 1 .. p`` only, as transformers does; the
    context length stays ``max_position_embeddings``. ``layer_types`` says which layers have the window
    (``"sliding_attention"``) and which attend to the whole context (``"full_attention"``); None: every
    layer has it (Mistral). No ``sliding_window``: no layer has one.

    The Gemma fields (defaults: what the Llama families do): ``query_pre_attn_scalar`` (the softmax
    scale is its inverse square root; None: ``head_dim``), ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (``cap * tanh(x / cap)`` on the attention scores and on the logits;
    None: none), ``sliding_rope_theta`` (the rope base of the sliding layers, which take no rope
    scaling; None: ``rope_theta`` and ``rope_scaling`` on every layer) and ``norm_weight_offset``
    (added to every RMSNorm weight: Gemma's Hugging Face checkpoints store ``weight - 1``, llama.cpp's
    Gemma GGUFs the weight itself).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # The attention window (keys a query sees, its own included) of the layers layer_types marks
    # "sliding_attention" (every layer when layer_types is None); None: full attention everywhere.
    sliding_window: int | None = None
    # The block format a GGUF file holds every projection in ("q4_1": Q4_1 layers and a Q8_0 head, as
    # SmolLM2's; "q8_0": all Q8_0), the weight format that multiplies by exactly those weights;
    # "native" for a file whose projections are in several formats, some of them a kernel's
    # (each projection then keeps its own where a kernel takes it: asyncinfer.models.quant); None
    # for any other file or a Hugging Face checkpoint. quantization="auto" picks it where it runs.
    native_format: str | None = None
    # Per layer, "full_attention" or "sliding_attention" (None: every layer as sliding_window says).
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_rope_theta: float | None = None
    norm_weight_offset: float = 0.0
    # The format a GGUF file stores each matrix in, by layer name ("layers.0.attn.qkv_proj", "lm_head"):
    # "float32", "float16", "bfloat16", a ggml block type in lower case ("q4_1", "q6_k"), or when the rows
    # of a fused layer come in different ones, each part's format and rows ("q4_k:576+q4_k:192+q6_k:192",
    # models.quant.mixed_format / mixed_parts); () for a Hugging Face checkpoint.
    stored_formats: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        model_family(self.architecture)  # raises ModelLoadError for an unregistered one
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers",
            "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelLoadError(f"model config: {name}={value!r} must be a positive int")
            check_config_size(name, value)
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim={self.head_dim} must be even for rope")
        for name in ("rms_norm_eps", "rope_theta"):
            if not positive_float32(getattr(self, name)):
                raise ModelLoadError(f"model config: {name}={getattr(self, name)!r} must be {POSITIVE_FLOAT32}")
        _validate_rope_scaling(self.rope_scaling, self.head_dim)
        self._validate_window()
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                     "sliding_rope_theta"):
            value = getattr(self, name)
            if value is not None and not positive_float32(value):
                raise ModelLoadError(f"model config: {name}={value!r} must be None or {POSITIVE_FLOAT32}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ModelLoadError("model config: eos_token_ids must be a tuple of ints")
        for tok in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ModelLoadError(
                    f"model config: special token id {tok!r} outside vocab [0, {self.vocab_size})"
                )

    def _validate_window(self) -> None:
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ModelLoadError(f"model config: sliding_window={window!r} must be None or a positive int")
        check_config_size("sliding_window", window)
        if self.layer_types is None:
            return
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"model config: layer_types must be a tuple of num_layers={self.num_layers} "
                                 f"entries, got {self.layer_types!r}")
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
        if unknown:
            raise ModelLoadError(f"unsupported attention layer type(s) {', '.join(map(repr, unknown))}; "
                                 f"supported: {', '.join(LAYER_TYPES)}")

    # ---- derived values -------------------------------------------------

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (keys a query sees, its own included), None: the whole context."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != SLIDING_ATTENTION:
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer attends within, None where any layer attends to the whole context.

        A KV block whose positions all lie before the last ``kv_window`` positions of a sequence is never
        read again by any layer, so the cache may give it back (``cache.KVCacheManager(sliding_window=)``):
        Mistral, Phi-3 with a window and a Qwen2 whose every layer slides have one; Gemma 2/3 (full layers between the sliding
        ones) and a model without a window have None.
        """
        if any(self.layer_window(layer) is None for layer in range(self.num_layers)):
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5`` (Gemma), else ``head_dim ** -0.5``."""
        scalar = self.query_pre_attn_scalar
        return (self.head_dim if scalar is None else scalar) ** -0.5

    @property
    def q_size(self) -> int:
        """Width of the query projection output (num_heads * head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim

    # ---- construction ---------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelConfig:
        """Normalise a transformers config of a registered family (``LlamaConfig``, ``Qwen2Config``,
        ``MistralConfig``, ``Qwen3Config``, ``Phi3Config``, ``Gemma2Config``, ``Gemma3TextConfig``, ...).

        Handles both the transformers 5 ``rope_parameters`` dict (per layer type for Gemma 3) and the
        older ``rope_theta``/``rope_scaling``/``rope_local_base_freq`` attributes. Raises ``ModelLoadError``
        for architectures or features the runner does not implement.
        """
        family = _hf_family(cfg)
        arch = family.name
        # Gemma's configs name it hidden_activation (an older hidden_act there is not what runs).
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
        if act != family.hidden_act:
            raise ModelLoadError(f"unsupported hidden_act {act!r} for {arch}; only {family.hidden_act!r} is implemented")
        # HF Llama/Mistral's attention_bias also adds an o_proj bias, which we don't implement;
        # a qkv_bias family (Qwen2) always has q/k/v bias and no o_proj bias.
        if not family.qkv_bias and getattr(cfg, "attention_bias", False):
            raise ModelLoadError(f"{arch} with attention_bias=True is not supported")
        if getattr(cfg, "mlp_bias", False):
            raise ModelLoadError("mlp_bias=True is not supported")

        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        rope_theta, rope_scaling = _hf_rope(cfg)
        window, layer_types = _hf_window(cfg, family)

        return cls(
            architecture=arch,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.max_position_embeddings),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=family.qkv_bias,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=normalise_token_ids(getattr(cfg, "eos_token_id", None)),
            sliding_window=window,
            layer_types=layer_types,
            query_pre_attn_scalar=_optional_float(getattr(cfg, "query_pre_attn_scalar", None)),
            attn_logit_softcapping=_optional_float(getattr(cfg, "attn_logit_softcapping", None)),
            final_logit_softcapping=_optional_float(getattr(cfg, "final_logit_softcapping", None)),
            sliding_rope_theta=_hf_sliding_rope_theta(cfg),
            norm_weight_offset=family.norm_weight_offset,
        )


def normalise_token_ids(value: Any) -> tuple[int, ...]:
    """Turn an ``eos_token_id`` that is None, an int or a list into a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))  # dedupe, keep order


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _hf_rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) from either transformers rope convention (per layer type:
    the full-attention layers', see :func:`_hf_sliding_rope_theta` for the sliding ones')."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        if set(params) - set(LAYER_TYPES) or not isinstance(params.get(FULL_ATTENTION), dict):
            raise ModelLoadError(f"unsupported per-layer-type rope parameters for layer types {sorted(params)}")
        params = params[FULL_ATTENTION]
        if "rope_theta" not in params:
            raise ModelLoadError("the full-attention layers' rope parameters have no rope_theta")
    if isinstance(params, dict) and "rope_theta" in params:
        # transformers 5: theta lives in rope_parameters next to the scaling keys.
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        # transformers 4: separate attributes; rope_scaling may be None.
        theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    partial = scaling.pop("partial_rotary_factor", None) or getattr(cfg, "partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        raise ModelLoadError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    # Old configs spell the key "type" instead of "rope_type"; Phi-3's first configs call longrope "su".
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type == "default":
        return theta, None
    if rope_type not in HF_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}; supported: {', '.join(HF_ROPE_TYPES)}")
    if rope_type in ("yarn", "longrope"):
        # As transformers reads it: the config's own original_max_position_embeddings takes priority (Phi-3 keeps
        # it beside rope_scaling), else rope_scaling's, else (longrope) the model's context.
        original = getattr(cfg, "original_max_position_embeddings", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        elif rope_type == "longrope":
            scaling.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    if rope_type == "yarn" and scaling.get("factor") is None and scaling.get("original_max_position_embeddings"):
        # a missing factor is the ratio of the context lengths (DeepSeek-V3's configs)
        scaling["factor"] = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
    if rope_type == "longrope":
        # The factor lists as tuples (the config is frozen); anything else is checked by ModelConfig.
        scaling.update({k: tuple(v) for k in ("short_factor", "long_factor")
                        if isinstance(v := scaling.get(k), list)})
    return theta, {"rope_type": rope_type, **scaling}


def _hf_sliding_rope_theta(cfg: Any) -> float | None:
    """The rope base of the sliding-window layers where a config gives them their own (Gemma 3:
    transformers 5's ``rope_parameters["sliding_attention"]``, older ``rope_local_base_freq``), else None.

    Raises:
        ModelLoadError: rope scaling on the sliding layers (not implemented).
    """
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(SLIDING_ATTENTION), dict):
        sliding = dict(params[SLIDING_ATTENTION])
        rope_type = sliding.get("rope_type") or sliding.get("type") or "default"
        if rope_type != "default":
            raise ModelLoadError(f"rope scaling {rope_type!r} on the sliding-window layers is not supported")
        return _optional_float(sliding.get("rope_theta"))
    return _optional_float(getattr(cfg, "rope_local_base_freq", None))


def _hf_window(cfg: Any, family: ModelFamily) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a transformers config: ``layer_types`` where the config lists
    them (Qwen2, Gemma; None when none is sliding), else every layer for a family whose window always
    applies (Mistral) or a config that sets ``use_sliding_window``."""
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None, None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        types = tuple(str(t) for t in layer_types)
        return (window, types) if SLIDING_ATTENTION in types else (None, None)
    if family.sliding_window or getattr(cfg, "use_sliding_window", False):
        return window, None
    return None, None


def _hf_family(cfg: Any) -> ModelFamily:
    """The registered family of a transformers config: by a class name in ``architectures``
    (a family may reuse another's config class), else by ``model_type``."""
    model_type = getattr(cfg, "model_type", None)
    _refuse_multimodal(model_type, getattr(cfg, "text_config", None) is not None)
    return _family_of(model_type, getattr(cfg, "architectures", None))


def hf_config_family(raw: Any, source: Any = "config.json") -> ModelFamily:
    """The registered family a parsed ``config.json`` names (as :meth:`ModelConfig.from_hf_config` picks it:
    a class name in ``architectures``, else ``model_type``), from the file's own names, before transformers
    parses it and before any weight is read.

    Raises:
        ModelLoadError: ``raw`` is not a JSON object (naming ``source``), a multimodal model (a
            ``text_config`` inside), or no family runs the model: the message names its ``model_type`` and
            ``architectures`` and lists the supported architectures.
    """
    if not isinstance(raw, dict):
        raise ModelLoadError(f"cannot read {source}: expected a JSON object, got {type(raw).__name__}")
    _refuse_multimodal(raw.get("model_type"), raw.get("text_config") is not None)
    architectures = raw.get("architectures")
    if not isinstance(architectures, list):
        architectures = None
    return _family_of(raw.get("model_type"), architectures)


def _refuse_multimodal(model_type: Any, has_text_config: bool) -> None:
    """A multimodal wrapper (e.g. ``Gemma3ForConditionalGeneration``, model_type ``gemma3``) is refused by
    name: only text decoders run, even where its text part's family is registered."""
    if has_text_config:
        raise ModelLoadError(f"unsupported model_type {model_type!r}: a multimodal model (only text decoders run; "
                             f"supported: {', '.join(supported_architectures())})")


def _family_of(model_type: Any, architectures: Any) -> ModelFamily:
    for name in (*(architectures or ()), model_type):
        family = find_model_family(name)
        if family is not None:
            return family
    named = f" (architectures: {', '.join(map(str, architectures))})" if architectures else ""
    raise ModelLoadError(
        f"unsupported model_type {model_type!r}{named}; supported: {', '.join(supported_architectures())}"
    )


def _validate_rope_scaling(scaling: dict[str, Any] | None, head_dim: int) -> None:
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"model config: rope_scaling must be a dict or None, got {scaling!r}")
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES or rope_type == "default":
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "yarn": ("factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
        "freq_factors": ("factors",),
    }[rope_type]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope type {rope_type!r} needs {', '.join(missing)} in rope_scaling")
    if rope_type == "freq_factors":
        factors = scaling["factors"]
        if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
            got = f"{len(factors)} entries" if isinstance(factors, (list, tuple)) else repr(factors)
            raise ModelLoadError(f"rope freq_factors has {got}, expected head_dim/2={head_dim // 2}")
        for i, factor in enumerate(factors):  # each divides a frequency: 0 made it inf, NaN every logit
            if not _positive_number(factor):
                raise ModelLoadError(f"rope freq_factors[{i}] must be a finite number > 0, got {factor!r}")
    if rope_type in ("linear", "llama3"):
        # each divides the frequencies or the context: 0 made every logit NaN, a negative or a text one
        # rotated backwards or failed in the first step
        for key in required:
            if not _positive_number(scaling[key]):
                raise ModelLoadError(f"{rope_type} rope: {key} must be a finite number > 0, got {scaling[key]!r}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ModelLoadError("llama3 rope needs high_freq_factor > low_freq_factor")
    if rope_type == "yarn":
        numbers = {k: scaling.get(k) for k in ("factor", "original_max_position_embeddings", "attention_factor",
                                                "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
        for key, value in numbers.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ModelLoadError(f"yarn rope: {key} must be a finite number >= 0, got {value!r}")
        if not numbers["factor"] > 0 or not numbers["original_max_position_embeddings"] >= 1:
            raise ModelLoadError(f"yarn rope needs factor > 0 and original_max_position_embeddings >= 1, got "
                                 f"{numbers['factor']!r} and {numbers['original_max_position_embeddings']!r}")
        if not isinstance(scaling.get("truncate", True), bool):
            raise ModelLoadError(f"yarn rope: truncate must be true or false, got {scaling['truncate']!r}")
    if rope_type == "longrope":
        _validate_longrope(scaling, head_dim)


def _validate_longrope(scaling: dict[str, Any], head_dim: int) -> None:
    """Longrope's parameters: ``short_factor`` / ``long_factor``, ``head_dim / 2`` finite numbers > 0 each (each
    divides one frequency); ``original_max_position_embeddings`` an int >= 2; ``factor`` and
    ``attention_factor``, where given, finite numbers > 0."""
    for key in ("short_factor", "long_factor"):
        factors = scaling[key]
        if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
            got = f"{len(factors)} entries" if isinstance(factors, (list, tuple)) else repr(factors)
            raise ModelLoadError(f"longrope rope: {key} must list head_dim/2={head_dim // 2} factors, got {got}")
        for i, factor in enumerate(factors):
            if not _positive_number(factor):
                raise ModelLoadError(f"longrope rope: {key}[{i}] must be a finite number > 0, got {factor!r}")
    original = scaling["original_max_position_embeddings"]
    if not isinstance(original, int) or isinstance(original, bool) or original < 2:  # log(original) divides
        raise ModelLoadError(f"longrope rope: original_max_position_embeddings must be an int >= 2, got {original!r}")
    for key in ("factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and not _positive_number(value):
            raise ModelLoadError(f"longrope rope: {key} must be a finite number > 0, got {value!r}")


def _positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)
