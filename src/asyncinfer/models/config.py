"""A normalised configuration for the decoders the runner supports.

``ModelConfig`` is the only description of a model the rest of asyncinfer sees.
It is built either from a transformers ``PretrainedConfig`` (``from_hf_config``)
or from GGUF metadata (see ``loader.py``), so that the model code never has to
know which checkpoint format, or which transformers version, it came from.
Which architectures exist, and their quirks, is the registry's business
(:mod:`asyncinfer.models.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.registry import ModelFamily, find_model_family, model_family, supported_architectures

# Rope types the rotary embedding implements; "default" means no scaling.
# "freq_factors" carries explicit per-frequency divisors (GGUF's rope_freqs tensor).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder of a registered family (Llama, Qwen2, Mistral).

    ``architecture`` is the family's registered name (``models.registry``).
    ``rope_scaling`` is ``None`` for plain rope, else a dict with at least
    ``"rope_type"`` (one of ``"linear"``, ``"llama3"``, ``"freq_factors"``) and
    that type's parameters, using the Hugging Face key names.
    ``attention_bias`` means bias on the q/k/v projections only (Qwen2).
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
    # The attention window a GGUF file declares (None: none declared; a Hugging Face
    # config's window caps max_position_embeddings instead, see _max_positions).
    sliding_window: int | None = None
    # The block format a GGUF file holds every projection in ("q4_1": Q4_1 layers and a Q8_0 head, as
    # SmolLM2's; "q8_0": all Q8_0), the weight format that multiplies by exactly those weights;
    # "native" for a file whose projections are in several formats, some of them a kernel's
    # (each projection then keeps its own where a kernel takes it: asyncinfer.models.quant); None
    # for any other file or a Hugging Face checkpoint. quantization="auto" picks it where it runs.
    native_format: str | None = None
    # The format a GGUF file stores each matrix in, by layer name ("layers.0.attn.qkv_proj", "lm_head"):
    # "float32", "float16", "bfloat16", a ggml block type in lower case ("q4_1", "q6_k"), or "mixed"
    # when the rows of a fused layer come in different ones; () for a Hugging Face checkpoint.
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
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"model config: head_dim={self.head_dim} must be even for rope")
        if not self.rms_norm_eps > 0:
            raise ModelLoadError(f"model config: rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        if not self.rope_theta > 0:
            raise ModelLoadError(f"model config: rope_theta={self.rope_theta!r} must be > 0")
        _validate_rope_scaling(self.rope_scaling, self.head_dim)
        if not isinstance(self.eos_token_ids, tuple):
            raise ModelLoadError("model config: eos_token_ids must be a tuple of ints")
        for tok in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ModelLoadError(
                    f"model config: special token id {tok!r} outside vocab [0, {self.vocab_size})"
                )

    # ---- derived values -------------------------------------------------

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
        """Normalise a transformers ``LlamaConfig``/``Qwen2Config``/``MistralConfig``.

        Handles both the transformers 5 ``rope_parameters`` dict and the older
        ``rope_theta``/``rope_scaling`` attributes. Raises ``ModelLoadError``
        for architectures or features the runner does not implement.
        """
        family = _hf_family(cfg)
        arch = family.name
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
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
            max_position_embeddings=_max_positions(cfg, family),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=family.qkv_bias,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_ids=normalise_token_ids(getattr(cfg, "eos_token_id", None)),
        )


def normalise_token_ids(value: Any) -> tuple[int, ...]:
    """Turn an ``eos_token_id`` that is None, an int or a list into a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))  # dedupe, keep order


def _hf_rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling) from either transformers rope convention."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError("per-layer-type rope parameters are not supported")
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
    # Old configs spell the key "type" instead of "rope_type".
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return theta, {"rope_type": rope_type, **scaling}


def _hf_family(cfg: Any) -> ModelFamily:
    """The registered family of a transformers config: by a class name in ``architectures``
    (a family may reuse another's config class), else by ``model_type``."""
    model_type = getattr(cfg, "model_type", None)
    for name in (*(getattr(cfg, "architectures", None) or ()), model_type):
        family = find_model_family(name)
        if family is not None:
            return family
    raise ModelLoadError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_architectures())}")


def _max_positions(cfg: Any, family: ModelFamily) -> int:
    """Positions the runner may use; capped at the sliding window where one applies.

    Sliding-window attention is not implemented, so capping the usable context
    at the window keeps results exact (within the window full attention and
    sliding-window attention are the same thing).
    """
    max_pos = int(cfg.max_position_embeddings)
    window = getattr(cfg, "sliding_window", None)
    uses_window = family.sliding_window or bool(getattr(cfg, "use_sliding_window", False))
    if uses_window and isinstance(window, int) and 0 < window < max_pos:
        return window
    return max_pos


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
        "freq_factors": ("factors",),
    }[rope_type]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope type {rope_type!r} needs {', '.join(missing)} in rope_scaling")
    if rope_type == "freq_factors" and len(scaling["factors"]) != head_dim // 2:
        raise ModelLoadError(
            f"rope freq_factors has {len(scaling['factors'])} entries, expected head_dim/2={head_dim // 2}"
        )
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ModelLoadError("llama3 rope needs high_freq_factor > low_freq_factor")
