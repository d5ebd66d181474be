"""Load a model of a registered family from a Hugging Face directory or a GGUF file.

The model is built on the meta device (no memory, no random init), each
parameter is allocated once on the target device, and checkpoint tensors are
copied into it one at a time (safetensors are memory-mapped, GGUF tensors are
dequantised one by one), so the checkpoint is never held twice in RAM.

The family's weight map (see :mod:`asyncinfer.models.registry`) is the single
table from checkpoint names (HF and GGUF spelling) to parameter names; q/k/v
and gate/up land in row slices of the fused params.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch
from torch import nn

from asyncinfer.errors import ModelLoadError
from asyncinfer.models.checkpoint import iter_safetensors, load_hf_tokenizer, read_json, safetensors_files
from asyncinfer.models.config import ModelConfig, normalise_token_ids
from asyncinfer.models.registry import model_family

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """What ``load_model`` returns. ``tokenizer`` is None for a directory without tokenizer files."""

    model: nn.Module  # the family's model class (LlamaForCausalLM for the built-in families)
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | None
    source: str  # "safetensors:<dir>" or "gguf:<file>"


# Checkpoint tensors that are derivable or redundant and safe to skip.
_IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq|rope_freqs\.weight)$")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter and the row range inside it."""

    param: str
    rows: slice | None  # None: the whole parameter


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Load weights, config and tokenizer from an HF safetensors directory or a ``.gguf`` file.

    A directory without ``config.json`` holding exactly one ``.gguf`` file is
    treated as that file. Raises ``ModelLoadError`` for a missing path, an
    unsupported architecture, or checkpoint tensors that are missing,
    unexpected or of the wrong shape.
    """
    path = _model_location(path)
    device = torch.device(device)
    if path.is_file():
        return _load_gguf(path, dtype, device)
    return _load_hf_dir(path, dtype, device)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's :class:`ModelConfig` from its metadata alone (config.json or the GGUF header).

    Resolves ``path`` exactly as :func:`load_model` does, and reads no weights.
    """
    path = _model_location(path)
    if path.is_file():
        return gguf_model_config(_gguf_reader(path))
    return _hf_model_config(path)


def _model_location(path: str | Path) -> Path:
    """The ``.gguf`` file or HF directory that ``path`` names; ``ModelLoadError`` if it is neither."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(
                f"{path} is not a model directory: no config.json and "
                f"{'no' if not ggufs else 'several'} .gguf files"
            )
        path = ggufs[0]
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is not a model: expected a directory or a .gguf file")
    return path


# ---- the weight table -------------------------------------------------------


def build_targets(config: ModelConfig, fmt: str) -> dict[str, _Target]:
    """Expand the family's weight map for this config: checkpoint name -> target, for ``fmt`` "hf" or "gguf"."""
    column = 0 if fmt == "hf" else 1
    shards = {
        "q": slice(0, config.q_size),
        "k": slice(config.q_size, config.q_size + config.kv_size),
        "v": slice(config.q_size + config.kv_size, config.q_size + 2 * config.kv_size),
        "gate": slice(0, config.intermediate_size),
        "up": slice(config.intermediate_size, 2 * config.intermediate_size),
    }
    targets: dict[str, _Target] = {}
    for row in model_family(config.architecture).weight_map:
        ckpt, param, shard = row[column], row[2], row[3]
        if param == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if param.endswith("qkv_proj.bias") and not config.attention_bias:
            continue
        # Non-layer names have no "{i}"; format() leaves them unchanged.
        for i in range(config.num_layers) if "{i}" in param else (0,):
            targets[ckpt.format(i=i)] = _Target(param.format(i=i), shards[shard] if shard else None)
    return targets


def _is_ignorable(name: str, config: ModelConfig) -> bool:
    # Tied checkpoints sometimes still store the (identical) output matrix.
    if config.tie_word_embeddings and name in ("lm_head.weight", "output.weight"):
        return True
    return bool(_IGNORED.match(name))


def _materialise(
    config: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    fmt: str,
    dtype: torch.dtype,
    device: torch.device,
) -> nn.Module:
    """Build the family's model on meta, then fill its parameters from (name, tensor) pairs.

    ``tensors`` yields CPU tensors; each is shape-checked against its target
    and copied (with dtype/device conversion) into place.
    """
    with torch.device("meta"):
        model = model_family(config.architecture).model_class(config)
    params = {name: p for name, p in model.named_parameters()}
    state = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in params.items()}
    targets = build_targets(config, fmt)
    seen: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors:
            target = targets.get(name)
            if target is None:
                if not _is_ignorable(name, config):
                    unexpected.append(name)
                continue
            dest = state[target.param] if target.rows is None else state[target.param][target.rows]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)} "
                    f"(for parameter {target.param!r})"
                )
            dest.copy_(tensor)
            seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {_preview(missing)}")
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {_preview(unexpected)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.init_buffers(device)  # non-persistent buffers: computed, not loaded
    return model.eval()


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---- Hugging Face directories ---------------------------------------------


def _hf_model_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    return ModelConfig.from_hf_config(hf_config)


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    config = _merge_generation_eos(_hf_model_config(path), path)
    model = _materialise(config, iter_safetensors(safetensors_files(path)), "hf", dtype, device)
    return LoadedModel(model, config, load_hf_tokenizer(path), f"safetensors:{path.resolve()}")


def _merge_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Add eos ids from generation_config.json (e.g. Llama 3's <|eot_id|>) to the config's."""
    gen_file = path / "generation_config.json"
    if not gen_file.exists():
        return config
    generation = read_json(gen_file)
    try:
        extra = normalise_token_ids(generation.get("eos_token_id"))
    except (AttributeError, ValueError, TypeError) as exc:  # not an object, or ids that are not ints
        raise ModelLoadError(f"cannot read {gen_file}: {exc}") from exc
    merged = tuple(dict.fromkeys((*config.eos_token_ids, *extra)))
    return replace(config, eos_token_ids=merged)


# ---- GGUF files -------------------------------------------------------------


def _gguf_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    reader = _gguf_reader(path)
    config = gguf_model_config(reader)
    model = _materialise(config, _iter_gguf(reader, config), "gguf", dtype, device)
    # A GGUF without tokenizer metadata (e.g. a test file) loads with tokenizer None.
    tokenizer = _gguf_tokenizer(path) if "tokenizer.ggml.model" in reader.fields else None
    return LoadedModel(model, config, tokenizer, f"gguf:{path.resolve()}")


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    """A GGUF metadata value; ``default`` if absent (error when no default)."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    """Build a ``ModelConfig`` from a ``GGUFReader``'s metadata (and its tensor list)."""
    arch = _field(reader, "general.architecture")
    family = model_family(arch, what="GGUF architecture", gguf=True)
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    vocab = _field(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else len(
            _field(reader, "tokenizer.ggml.tokens")
        )
    eos = normalise_token_ids(_field(reader, "tokenizer.ggml.eos_token_id", None))
    eot = normalise_token_ids(_field(reader, "tokenizer.ggml.eot_token_id", None))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=family.qkv_bias,
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_ids=tuple(dict.fromkeys((*eos, *eot))),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _gguf_rope_scaling(reader: Any, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    """Rope scaling from GGUF: linear from metadata; Llama 3.1's as explicit frequency factors."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    has_factors = "rope_freqs.weight" in tensors
    if kind not in ("none", "linear") or (kind == "linear" and has_factors):
        raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    if has_factors:
        # llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors.
        import gguf

        t = tensors["rope_freqs.weight"]
        factors = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)
        return {"rope_type": "freq_factors", "factors": tuple(float(f) for f in factors)}
    return None


def _iter_gguf(reader: Any, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantise GGUF tensors one at a time to float32 CPU tensors in HF layout."""
    from gguf import quants

    permuted = model_family(config.architecture).gguf_permuted_qk
    for t in reader.tensors:
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(f"GGUF tensor {t.name!r}: {t.tensor_type.name} is not supported: {exc}") from exc
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        array = array.reshape(tuple(int(d) for d in reversed(t.shape)))
        if permuted:
            if t.name.endswith("attn_q.weight"):
                array = _unpermute_rope_rows(array, config.num_heads)
            elif t.name.endswith("attn_k.weight"):
                array = _unpermute_rope_rows(array, config.num_kv_heads)
        yield t.name, _as_tensor(array)


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """Wrap without copying; F32 tensors are read-only memmap views, which we only read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(array)


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation so rope's rotate_half convention holds.

    llama.cpp's converter interleaves each head's two rope halves (rows
    ``[a0..a_{n-1}, b0..b_{n-1}]`` become ``[a0, b0, a1, b1, ...]``) for its
    GPT-J-style rope; this puts the halves back one after the other.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [heads, D/2, 2, cols]
        .swapaxes(1, 2)  # [heads, 2, D/2, cols]
        .reshape(weight.shape)  # [rows, cols]
    )


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {exc}") from exc
