"""Load a model of a registered family from a Hugging Face directory or a GGUF file.

The model is built on the meta device (no memory, no random init:
:func:`~asyncinfer.models.meta.build_on_meta`), each parameter is allocated
once on the target device, and checkpoint tensors are copied into it one at a
time (safetensors are memory-mapped); a dequantised GGUF tensor that fills a
whole parameter becomes that parameter without a copy. The checkpoint is never
held twice in RAM.

A checkpoint is opened once (:func:`open_checkpoint`): its config comes from
that one read of config.json or the GGUF header, so the memory plan is made
before any weight is read, and the weights are then loaded from the same parse.
A GGUF header is checked against its tensor index there (:func:`gguf_config`), so a
file whose metadata disagrees with its tensors is refused before anything of the
model's size exists.

Given a weight format (``Checkpoint.load(..., weight_format=...)``, what the engine
passes on a CPU), a GGUF file's projections are built in it as they are read:
:func:`~asyncinfer.models.quant.apply_weight_format` takes the memory-mapped file
as the source of each layer's weights (:class:`_GGUFProjections`), a layer in its
file's own block format is repacked from those blocks (a lone tensor copied into huge
pages where they are granted: :func:`off_the_map`), and the file's pages of each
tensor are dropped once it has been copied; under a block format the embedding stays
in its file's blocks too (``quant.BlockEmbedding``; a tied head's blocks are its own);
only the parameters left (norms, a float embedding) are then filled. No float32 copy
of the model exists (docs/memory.md).
A GGUF file's tokenizer is built by transformers once and cached as
``tokenizer.json`` (:func:`gguf_tokenizer`), then read back without importing transformers
(:class:`~asyncinfer.models.tokenizer.CachedTokenizer`); it loads in parallel with the weights.

The family's weight map (see :mod:`asyncinfer.models.registry`) is the single
table from checkpoint names (HF and GGUF spelling) to parameter names; q/k/v
and gate/up land in row slices of the fused params.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from asyncinfer import kernels
from asyncinfer.errors import ModelLoadError
from asyncinfer.models import tokenizer_build
from asyncinfer.models.checkpoint import (
    iter_safetensors,
    load_hf_tokenizer,
    read_json,
    safetensors_files,
    tensor_names,
)
from asyncinfer.models.config import (
    FULL_ATTENTION,
    HF_SIZE_KEYS,
    SLIDING_ATTENTION,
    ModelConfig,
    check_config_size,
    check_config_sizes,
    hf_config_family,
    normalise_token_ids,
)
from asyncinfer.models.gguf_file import GGUFFile, GGUFTensor
from asyncinfer.models.hf_imports import transformers_imports
from asyncinfer.models.layers import EAGER_OPS, ElementwiseOps
from asyncinfer.models.meta import build_on_meta
from asyncinfer.models.quant import (
    BLOCK_FORMATS,
    BLOCK_HEAD_FORMAT,
    NATIVE,
    WeightFormat,
    apply_weight_format,
    embedding_formats,
    layer_formats,
    mixed_format,
    mixed_parts,
)
from asyncinfer.models.registry import model_family, supported_architectures
from asyncinfer.models.tokenizer import CachedTokenizer, load_cached
from asyncinfer.progress import TerminalProgress, say

logger = logging.getLogger("asyncinfer")

# (tensors done, tensors in all): called after each checkpoint tensor is in place.
Progress = Callable[[int, int], None]

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """What ``load_model`` returns. ``tokenizer`` is None for a directory without tokenizer files."""

    model: nn.Module  # the family's model class (LlamaForCausalLM for the built-in families)
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase | CachedTokenizer | None  # CachedTokenizer: a GGUF file's, from its cache
    source: str  # "safetensors:<dir>" or "gguf:<file>"
    # The weight format the model was built in at load (a GGUF file's projections straight from its blocks),
    # or None: its projections are plain float layers, for apply_weight_format to convert.
    weight_format: WeightFormat | None = None


# Checkpoint tensors that are derivable or redundant and safe to skip.
_IGNORED = re.compile(r"(.*\.rotary_emb\.inv_freq|rope_freqs\.weight|rope_factors_(long|short)\.weight)$")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter and the row range inside it."""

    param: str
    rows: slice | None  # None: the whole parameter


@dataclass
class Checkpoint:
    """A model's files, opened once: the config is read, the weights are not (see :meth:`load`)."""

    path: Path  # the .gguf file or the HF directory
    config: ModelConfig
    gguf: GGUFFile | None = None

    @property
    def num_tensors(self) -> int:
        return len(self.gguf.tensors) if self.gguf is not None else len(build_targets(self.config, "hf"))

    def load(self, dtype: torch.dtype, device: torch.device | str, progress: Progress | None = None, *,
             ops: ElementwiseOps = EAGER_OPS, weight_format: WeightFormat | None = None) -> LoadedModel:
        """Read the weights (and the tokenizer) into a :class:`LoadedModel` on ``device``.

        ``ops``: the element-wise functions the model is built with (the eager ones by default; the
        compiled ones with ``torch_compile=True``, see :mod:`asyncinfer.models.torch_compile`).
        ``weight_format``: on a CPU, a GGUF file's projections are built in it as they are read
        (:func:`~asyncinfer.models.quant.apply_weight_format` with the file as the source: a layer in its
        file's own block format straight from the mapped blocks), never through a float32 model; the
        result's ``weight_format`` says so. None (or a Hugging Face directory): plain float layers.

        Raises:
            ModelLoadError: checkpoint tensors that are missing, unexpected or of the wrong shape.
        """
        device = torch.device(device)
        if progress is None:
            progress = TerminalProgress(f"loading {self.path.name}", "tensors")
        if self.gguf is not None:
            if device.type != "cpu":
                weight_format = None
            return _load_gguf(self.gguf, self.config, dtype, device, progress, ops, weight_format)
        return _load_hf_dir(self.path, self.config, dtype, device, progress, ops)


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open an HF safetensors directory or a ``.gguf`` file and read its config (no weights).

    A directory without ``config.json`` holding exactly one ``.gguf`` file is
    treated as that file.

    Raises:
        ModelLoadError: a missing path, an unreadable config or header, an unsupported architecture.
    """
    path = _model_location(path)
    if path.is_file():
        gguf = GGUFFile(path)
        return Checkpoint(path, gguf_config(gguf), gguf)
    return Checkpoint(path, _merge_generation_eos(_hf_model_config(path), path))


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Load weights, config and tokenizer from an HF safetensors directory or a ``.gguf`` file.

    Raises ``ModelLoadError`` for a missing path, an unsupported architecture, or
    checkpoint tensors that are missing, unexpected or of the wrong shape.
    """
    return open_checkpoint(path).load(dtype, device)


def read_model_config(path: str | Path) -> ModelConfig:
    """The model's :class:`ModelConfig` from its metadata alone (config.json or the GGUF header).

    Resolves ``path`` exactly as :func:`load_model` does, and reads no weights.
    """
    return open_checkpoint(path).config


def _model_location(path: str | Path) -> Path:
    """The ``.gguf`` file or HF directory that ``path`` names; ``ModelLoadError`` if it is neither."""
    path = Path(os.path.expanduser(path))
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise ModelLoadError(f"{path} is not a model directory: no config.json and no .gguf files")
        if len(ggufs) > 1:
            shown = ", ".join(str(g) for g in ggufs[:4]) + (f", ... ({len(ggufs) - 4} more)" if len(ggufs) > 4 else "")
            raise ModelLoadError(f"{path} is not a model directory: no config.json and {len(ggufs)} .gguf files; "
                                 f"give one of them: {shown}")
        path = ggufs[0]
    if path.is_file() and path.suffix.lower() != ".gguf":  # MODEL.GGUF is one too
        hint = ""
        if (path.parent / "config.json").is_file():  # a checkpoint's own file (model.safetensors, config.json)
            hint = f"; its directory {path.parent} is a Hugging Face model directory: give that"
        raise ModelLoadError(f"{path} is not a model: expected a directory or a .gguf file{hint}")
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
    *,
    adopt: bool = False,
    progress: Progress | None = None,
    ops: ElementwiseOps = EAGER_OPS,
    model: nn.Module | None = None,
    done: int = 0,
) -> nn.Module:
    """Build the family's model on meta, then fill its parameters from (name, tensor) pairs.

    ``tensors`` yields CPU tensors; each is shape-checked against its target and
    copied (with dtype/device conversion) into place. ``adopt``: the tensors are
    fresh and owned by nobody else, so one that fills a whole parameter in the
    right dtype and device becomes that parameter without a copy. ``ops``: what the model computes its
    element-wise chains with. ``model``: a model already built on meta whose weight-format layers are in
    place (their checkpoint tensors are consumed: ``done`` of them); only its parameters left are filled.
    """
    all_targets = build_targets(config, fmt)
    if model is None:
        model = build_on_meta(config, ops)
    params = {name: p for name, p in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    targets = {name: t for name, t in all_targets.items() if t.param in params}
    seen: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in tensors:
            target = targets.get(name)
            if target is None:
                if name not in all_targets and not _is_ignorable(name, config):
                    unexpected.append(name)
                continue
            shape = params[target.param].shape
            expected = tuple(shape) if target.rows is None else (target.rows.stop - target.rows.start, *shape[1:])
            if tuple(tensor.shape) != expected:
                sizes = "config.json's sizes" if fmt == "hf" else "the GGUF header's sizes"
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                    f"(for parameter {target.param!r}, from {sizes}: do they belong to these weights?)"
                )
            if adopt and target.rows is None and tensor.dtype == dtype and tensor.device == device:
                state[target.param] = tensor
            else:
                if target.param not in state:
                    state[target.param] = torch.empty(shape, dtype=dtype, device=device)
                dest = state[target.param]
                _check_fits(name, tensor, dest.dtype)
                _copy(dest if target.rows is None else dest[target.rows], tensor)
            seen.add(name)
            if progress is not None:
                progress(done + len(seen), done + len(targets))
    missing = sorted(set(targets) - seen)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {_preview(missing)}")
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {_preview(unexpected)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.init_buffers(device)  # non-persistent buffers: computed, not loaded
    return model.eval()


def _check_fits(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Refuse, naming it, a float tensor holding a value that ``dtype`` float16 rounds to an infinity (|w| >= 65520):
    converted, it became an inf without a word, and every output it fed NaN (``quantization="float16"`` refused it)."""
    if dtype != torch.float16 or tensor.dtype == torch.float16 or not tensor.is_floating_point() or not tensor.numel():
        return
    low, high = torch.aminmax(tensor)  # no copy of the tensor
    largest = max(-float(low), float(high))
    if largest >= kernels.F16_ROUNDS_TO_INF:
        raise ModelLoadError(f"tensor {name!r} holds a value of magnitude {largest:g}, which float16 cannot hold "
                             f"(dtype='float16' rounds |w| >= {kernels.F16_ROUNDS_TO_INF:g} to an infinity); "
                             f"load it with dtype='bfloat16' or 'float32'")


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)``; float32 CPU to CPU through numpy's single thread, which never
    spin-waits for busy cores as torch's intra-op threads do (seconds on a loaded 2-core machine)."""
    if dest.device.type == src.device.type == "cpu" and dest.dtype == src.dtype == torch.float32:
        np.copyto(dest.numpy(), src.numpy())
    else:
        dest.copy_(src)


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---- Hugging Face directories ---------------------------------------------


def _hf_model_config(path: Path) -> ModelConfig:
    with transformers_imports():
        from transformers import AutoConfig

    # An architecture no family runs is refused from config.json's names, before transformers parses it
    # (which fails on model types it does not know without naming what runs here) and before any weight.
    raw = read_json(path / "config.json")
    family = hf_config_family(raw, path / "config.json")
    _check_not_prequantized(raw, path / "config.json")
    _check_hf_layer_count(path, raw, family.weight_map)  # before transformers builds anything one a layer
    check_config_sizes(raw, HF_SIZE_KEYS, str(path / "config.json"))  # before transformers or ModelConfig reads one
    _check_model_type_known(raw)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a bad config
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    return ModelConfig.from_hf_config(hf_config)


def _check_not_prequantized(raw: dict[str, Any], file: Path) -> None:
    """A checkpoint quantized by another tool (config.json's ``quantization_config`` with a ``quant_method``: AWQ,
    GPTQ, FP8, bitsandbytes, ...) stores its projections in that method's own tensors (``qweight``, ``scales``,
    ``weight_scale_inv``, ...), which no family reads: refused by name from the config, before any weight is read
    or any memory planned from float shapes. It was a list of missing or unexpected tensors once the weights were
    read, and ``plan`` / ``info`` planned it as a float checkpoint."""
    quantization = raw.get("quantization_config")
    if not isinstance(quantization, dict) or "quant_method" not in quantization:
        return
    method = quantization["quant_method"]
    raise ModelLoadError(
        f"{file}: a pre-quantized checkpoint (quantization_config.quant_method = {method!r}) is not supported: its "
        "weights are stored in that method's own tensors, which asyncinfer does not read; load the float checkpoint "
        "(float16, bfloat16 or float32 weights) and pick a weight format with quantization= (e.g. 'q4_0', 'q4_k', "
        "'q8_0'; docs/formats.md), or a GGUF file of the model")


def _check_model_type_known(raw: dict[str, Any]) -> None:
    """A config.json whose ``architectures`` name a family that runs here but whose ``model_type`` transformers does
    not know (a typo, a renamed or custom type) is refused as an unsupported model_type, naming both and the
    supported architectures, as any other architecture is: transformers' own refusal tells the user to upgrade
    transformers, which would not make it load."""
    with transformers_imports():
        from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    architectures = raw.get("architectures")
    named = f" (architectures: {', '.join(map(str, architectures))})" if isinstance(architectures, list) else ""
    raise ModelLoadError(f"unsupported model_type {model_type!r}{named}: transformers has no config for it; "
                         f"supported: {', '.join(supported_architectures())} (config.json's model_type names one)")


_MIN_LAYER_BYTES = 32  # a layer's tensors take at least one entry of a shard's header: more than 32 bytes of JSON
_UNCOUNTED_LAYERS = 4096  # the count a directory whose shards are not read may still give (a config read for a plan)


def _check_hf_layer_count(path: Path, raw: dict[str, Any], weight_map: Any) -> None:
    """Refuse a config.json whose ``num_hidden_layers`` (an int) is more than the layers its shards hold (their
    headers' tensor names), before transformers parses it: its config classes build a list of one entry a layer
    (Gemma's and Qwen's ``layer_types``), so a count of 10**10 took all of the machine's memory. A directory
    without shards (a config read for a memory plan) or with an unreadable one is left to the load, which refuses
    it once the config itself has been read; its count is only bounded by the bytes its shards could hold (at
    least :data:`_UNCOUNTED_LAYERS`)."""
    count = raw.get("num_hidden_layers")
    if not isinstance(count, int) or isinstance(count, bool):
        return  # absent or no int: transformers and ModelConfig say so
    prefixes = {row[0].split("{i}")[0] for row in weight_map if "{i}" in row[0]}
    layer = re.compile("(?:" + "|".join(map(re.escape, sorted(prefixes))) + r")(\d+)\.")
    try:
        held = max((int(m.group(1)) + 1 for name in tensor_names(safetensors_files(path))
                    if (m := layer.match(name))), default=0)
    except ModelLoadError:  # no shards, or one whose header is unreadable: the load refuses it, after the config's
        size = sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())  # own errors; the count is
        most = max(size // _MIN_LAYER_BYTES, _UNCOUNTED_LAYERS)  # still bounded by the bytes the shards could hold
        if count > most:
            raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers = {count} is more layers than its "
                                 f"weights could hold ({size} bytes of *.safetensors shards: at most {most})") from None
        return
    if count > held:
        raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers = {count}, but its weights hold {held} "
                             "layer(s)")


def _load_hf_dir(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, progress: Progress | None,
    ops: ElementwiseOps,
) -> LoadedModel:
    model = _materialise(config, iter_safetensors(safetensors_files(path)), "hf", dtype, device, progress=progress,
                         ops=ops)
    return LoadedModel(model, config, load_hf_tokenizer(path, config.vocab_size), f"safetensors:{path.resolve()}")


def _merge_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """Add eos ids from generation_config.json (e.g. Llama 3's <|eot_id|>) to the config's."""
    gen_file = path / "generation_config.json"
    if not gen_file.exists():
        return config
    generation = read_json(gen_file)
    try:
        extra = normalise_token_ids(generation.get("eos_token_id"))
    except (AttributeError, ValueError, TypeError, OverflowError) as exc:  # not an object, ids not ints (Infinity)
        raise ModelLoadError(f"cannot read {gen_file}: {exc}") from exc
    merged = tuple(dict.fromkeys((*config.eos_token_ids, *extra)))
    return replace(config, eos_token_ids=merged)


# ---- GGUF files -------------------------------------------------------------


def _load_gguf(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: torch.device, progress: Progress | None,
    ops: ElementwiseOps, weight_format: WeightFormat | None = None,
) -> LoadedModel:
    def weights() -> nn.Module:
        if weight_format is None:
            return _materialise(config, _iter_gguf(gguf, config, dtype), "gguf", dtype, device, adopt=True,
                                progress=progress, ops=ops)
        return _build_in_format(gguf, config, dtype, device, progress, ops, weight_format)

    source = f"gguf:{gguf.path.resolve()}"
    # A GGUF without tokenizer metadata (e.g. a test file) loads with tokenizer None.
    if "tokenizer.ggml.model" not in gguf.fields:
        return LoadedModel(weights(), config, None, source, weight_format)
    _check_vocabulary_fits(gguf, config)
    _check_tokenizer_metadata(gguf)
    # The tokenizer (mostly Python) loads while the weights (torch ops, which drop the GIL) dequantise.
    with ThreadPoolExecutor(1, thread_name_prefix="asyncinfer-tokenizer") as pool:
        tokenizer = pool.submit(gguf_tokenizer, gguf.path, gguf, config.vocab_size)
        model = weights()
        return LoadedModel(model, config, tokenizer.result(), source, weight_format)


def _check_vocabulary_fits(gguf: GGUFFile, config: ModelConfig) -> None:
    """Refuse, before the tokenizer is built, a vocabulary of more distinct tokens than the model embeds: the
    tokenizer it builds would hold at least as many, and :func:`asyncinfer.loading.check_tokenizer` refuses it then.
    Built first, a header's 8 million tokens took minutes of transformers' conversion and GBs of memory to be refused.

    Raises:
        ModelLoadError: naming ``tokenizer.ggml.tokens``, its count and the model's ``vocab_size``.
    """
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or len(tokens) <= config.vocab_size:
        return
    distinct = len({token for token in tokens if isinstance(token, str)})
    if distinct > config.vocab_size:
        raise ModelLoadError(f"the tokenizer has {distinct} tokens (GGUF metadata tokenizer.ggml.tokens of "
                             f"{gguf.path}) but the model embeds only {config.vocab_size}")


# The special tokens transformers' GGUF conversion looks up in the vocabulary by id (``tokens[id]``).
_GGUF_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def _check_tokenizer_metadata(gguf: GGUFFile) -> None:
    """Refuse, before the tokenizer is built, the tokenizer metadata that transformers' conversion cannot follow: no
    vocabulary (or one that is not strings), merges that are not two pieces parted by a space, a bos, eos, unknown or
    padding token id that is not an index of the vocabulary. Built first, such a file failed seconds later with
    transformers' own words ("list index out of range"), naming neither the key nor the value.

    Raises:
        ModelLoadError: naming the key (``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` or the special id's),
            the value at fault and the file.
    """
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(token, str) for token in tokens):
        what = "empty" if tokens == [] else "absent" if tokens is None else "not a list of strings"
        raise ModelLoadError(f"GGUF file {gguf.path}: metadata tokenizer.ggml.tokens is {what}; a tokenizer needs a "
                             "vocabulary of at least one token")
    merges = gguf.fields.get("tokenizer.ggml.merges")
    if merges is not None:
        bad = next((merge for merge in merges if not isinstance(merge, str) or merge.count(" ") != 1), None) \
            if isinstance(merges, list) else merges
        if bad is not None:
            raise ModelLoadError(f"GGUF file {gguf.path}: metadata tokenizer.ggml.merges holds {bad!r:.80}; each "
                                 "merge must be a string of two pieces parted by one space")
    for key in _GGUF_SPECIAL_IDS:
        token_id = gguf.fields.get(f"tokenizer.ggml.{key}")
        if token_id is not None and (isinstance(token_id, bool) or not isinstance(token_id, int)
                                     or not 0 <= token_id < len(tokens)):
            raise ModelLoadError(f"GGUF file {gguf.path}: metadata tokenizer.ggml.{key} = {token_id!r:.80} is not a "
                                 f"token of its vocabulary (an integer in [0, {len(tokens) - 1}], tokenizer.ggml.tokens "
                                 f"holds {len(tokens)})")


def _build_in_format(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: torch.device, progress: Progress | None,
    ops: ElementwiseOps, weight_format: WeightFormat,
) -> nn.Module:
    """The model with its projections in ``weight_format``, each built from the file as it is read (its own
    blocks where it keeps them), then every other parameter filled from the file; the float32 model never exists."""
    model = build_on_meta(config, ops)
    head = next(name for name, p in model.named_parameters() if p is model.lm_head_weight)  # family contract
    projections = _GGUFProjections(gguf, config, head, progress)
    apply_weight_format(model, weight_format.method, weight_format.skip, pack=weight_format.pack,
                        source=projections, activation_dtype=weight_format.activation_dtype)
    model = _materialise(config, _iter_gguf(gguf, config, dtype, skip=projections.consumed), "gguf", dtype, device,
                         adopt=True, progress=progress, ops=ops, model=model, done=len(projections.consumed))
    _trim_heap()
    return model


def _heap_trimmer() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)`` where there is one (a no-op elsewhere): the temporaries of building a layer
    (tens of MiB) are freed into the allocator's per-thread arenas, which keep them; ~140 MiB of them for a
    250 MiB file, on top of the weights, until they are handed back."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def trim_heap() -> None:
        trim(0)

    return trim_heap


_trim_heap = _heap_trimmer()


class _GGUFProjections:
    """The loader's :data:`~asyncinfer.models.quant.WeightSource` for a GGUF file: a layer name -> its tensors
    (the row shards of a fused layer, q/k rows put back in rope order, its bias), read from the memory map."""

    def __init__(self, reader: GGUFFile, config: ModelConfig, head: str, progress: Progress | None) -> None:
        self._reader = reader
        self._config = config
        self._progress = progress
        targets = build_targets(config, "gguf")
        self._layers = _gguf_layers(reader, targets, head)
        self._total = len(targets)
        # The layers that read each tensor: a tied head reads the embedding's, which the embedding still needs (its
        # blocks, or floats where it stays a float table); a tensor is consumed once every reader has released it.
        self._readers = Counter(t.name for weight, bias in self._layers.values() for t in weight + bias)
        self._embeddings = set(embedding_formats(config, None))  # read a few rows a step: left in the map
        self.consumed: set[str] = set()  # tensor names read into a layer (and needed by nothing else)
        self._lock = threading.Lock()

    def __call__(self, layer: str) -> _GGUFProjection:
        if layer not in self._layers:
            raise ModelLoadError(f"GGUF file {self._reader.path} has no tensors for layer {layer!r}")
        weight, bias = self._layers[layer]
        return _GGUFProjection(self, weight, bias, streamed=layer not in self._embeddings)

    def done(self, tensors: list[GGUFTensor]) -> None:
        """Called by the layer builders (on apply_weight_format's threads) once a layer is built."""
        for t in tensors:
            self._reader.release(t)  # copied into the layer: the file's pages may go
        _trim_heap()  # and the layer's temporaries (joined rows, dequantised floats) too
        with self._lock:
            self._readers.subtract(t.name for t in tensors)
            self.consumed.update(t.name for t in tensors if self._readers[t.name] <= 0)
            if self._progress is not None:
                self._progress(len(self.consumed), self._total)


class _GGUFProjection:
    """One layer's weights in a GGUF file (a :class:`~asyncinfer.models.quant.StoredProjection`)."""

    def __init__(self, owner: _GGUFProjections, weight: list[GGUFTensor], bias: list[GGUFTensor], *,
                 streamed: bool) -> None:
        self._owner = owner
        self._streamed = streamed  # a projection every step reads whole (not an embedding): kept off the map
        self._reader = owner._reader
        self._weight, self._bias = weight, bias
        self.format = _stored_format(weight)

    def _heads(self, t: GGUFTensor) -> int | None:
        return _permuted_heads(t.name, self._owner._config)

    def blocks(self) -> torch.Tensor:
        parts = []
        for t in self._weight:
            rows = self._reader.blocks(t)  # [rows, bytes per row], a view of the map
            heads = self._heads(t)
            parts.append(rows if heads is None else torch.from_numpy(_unpermute_rope_rows(rows.numpy(), heads)))
        if len(parts) == 1:
            return off_the_map(parts[0], self.format) if self._streamed else parts[0]
        # joined (q, k, v; gate, up): a copy the layer keeps, made in huge pages where granted (kernels.joined_rows);
        # the parts' rows are one size (one format, and their shapes were checked against the config from the header)
        return kernels.joined_rows(parts)

    def part_blocks(self, part: int) -> torch.Tensor:
        t = self._weight[part]
        rows = self._reader.blocks(t)  # [rows, bytes per row], a view of the map
        heads = self._heads(t)
        rows = rows if heads is None else torch.from_numpy(_unpermute_rope_rows(rows.numpy(), heads))
        return off_the_map(rows, _stored_format([t])) if self._streamed else rows

    def floats(self) -> torch.Tensor:
        parts = []
        for t in self._weight:
            w = self._reader.dequantize(t).reshape(t.rows, -1)  # [rows, cols] float32, a new tensor
            heads = self._heads(t)
            parts.append(w if heads is None else torch.from_numpy(_unpermute_rope_rows(w.numpy(), heads)))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def bias(self) -> torch.Tensor | None:
        if not self._bias:
            return None
        parts = [self._reader.dequantize(t).reshape(-1) for t in self._bias]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def release(self) -> None:
        self._owner.done(self._weight + self._bias)


#: The block formats a layer keeps in ggml's layout as the file holds them (Q4_1 and Q8_0 are regrouped by
#: kernels.pack, Q4_0 and Q4_1 may be laid out in lanes: each a copy of its own), which off_the_map moves.
AS_STORED = frozenset(name for name, layout in kernels.formats.LAYOUTS.items()
                      if not layout.regrouped and name not in kernels.LANES_FORMATS.values())


def off_the_map(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """A layer's blocks in ``fmt`` (one tensor of the file, or its rows put back in rope order) as the layer keeps
    them: where the layer keeps ``fmt`` as stored (:data:`AS_STORED`), a copy in huge pages where Linux grants them
    and the blocks fill at least one (:func:`kernels.in_huge_pages`; the file's pages are released once the layer is
    built, so the bytes are held once), else as they are (the file's map, 4 KiB pages; a format the kernels repack
    is copied there, once). A decode step streams every weight: from the map the CPU's prefetchers stop at each 4 KiB
    page and the TLB misses every 64 lines: off the map, one request of the 1B Q4_K_M file ran 1.16x its rate in
    the map (docs/formats.md, "The file's single tensors in huge pages")."""
    if fmt in AS_STORED and blocks.numel() >= kernels.HUGE_PAGE and kernels.huge_pages():
        return kernels.in_huge_pages(blocks)
    return blocks


def _gguf_layers(reader: GGUFFile, targets: dict[str, _Target],
                 head: str) -> dict[str, tuple[list[GGUFTensor], list[GGUFTensor]]]:
    """Layer name -> (weight tensors, bias tensors) in row order, for every parameter of the weight map;
    ``"lm_head"`` is the tensor of ``head`` (the output projection's parameter: the embedding when tied)."""
    index = {t.name: t for t in reader.tensors}
    grouped: dict[str, list[tuple[int, GGUFTensor]]] = {}
    for name, target in targets.items():
        if name in index:
            grouped.setdefault(target.param, []).append((0 if target.rows is None else target.rows.start, index[name]))
    layers: dict[str, tuple[list[GGUFTensor], list[GGUFTensor]]] = {}
    for param, parts in grouped.items():
        layer, _, kind = param.rpartition(".")
        tensors = [t for _, t in sorted(parts, key=lambda part: part[0])]
        weight, bias = layers.get(layer, ([], []))
        layers[layer] = (tensors, bias) if kind == "weight" else (weight, tensors)
    if head.rpartition(".")[0] in layers:
        layers["lm_head"] = (layers[head.rpartition(".")[0]][0], [])
    return layers


def _permuted_heads(name: str, config: ModelConfig) -> int | None:
    """The head count whose rope rows llama.cpp interleaved in tensor ``name`` (undone at load), or None."""
    if not model_family(config.architecture).gguf_permuted_qk:
        return None
    if name.endswith("attn_q.weight"):
        return config.num_heads
    if name.endswith("attn_k.weight"):
        return config.num_kv_heads
    return None


def _field(reader: GGUFFile, key: str, default: Any = ...) -> Any:
    """A GGUF metadata value; ``default`` if absent (error when no default)."""
    if key not in reader.fields:
        if default is ...:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    return reader.fields[key]


def gguf_config(reader: GGUFFile) -> ModelConfig:
    """The model's config from a GGUF header (:func:`gguf_model_config`), checked against the file's tensor
    index and with the formats the file stores each projection in (``stored_formats``, ``native_format``).

    Decided from the header alone, before anything of the model's size is allocated: a block count that
    the tensors do not hold, a size larger than any tensor, a tensor missing, unexpected or of another
    shape than the metadata makes it.

    Raises:
        ModelLoadError: naming the metadata key or the tensor.
    """
    arch = reader.fields.get("general.architecture")
    if isinstance(arch, str):  # an architecture no family runs is named first, before its metadata's checks
        model_family(arch, what="GGUF architecture", gguf=True)
    for key in _GGUF_SIZE_KEYS:  # before anything is built from them
        _check_number(reader, f"{arch}.{key}", int)
        check_config_size(f"metadata {arch}.{key}", reader.fields.get(f"{arch}.{key}"), f"GGUF file {reader.path}")
    for key in _GGUF_REAL_KEYS:
        _check_number(reader, f"{arch}.{key}", (int, float))
    _check_block_count(reader, arch, reader.fields.get(f"{arch}.block_count"))  # before any per-layer work
    try:
        config = gguf_model_config(reader)
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError) as exc:  # a value of the wrong kind
        raise ModelLoadError(f"cannot read GGUF file {reader.path}: metadata of the wrong kind ({exc})") from exc
    stored = _check_index(reader, config)
    embeddings = embedding_formats(config, None)  # the formats the projections are multiplied in say "native"
    projections = tuple((name, fmt) for name, fmt in stored if name not in embeddings)
    return replace(config, stored_formats=stored, native_format=_native_format(projections))


#: The size keys of a GGUF header (after ``<arch>.``), each held to MAX_CONFIG_SIZE as the header is read.
_GGUF_SIZE_KEYS = ("embedding_length", "feed_forward_length", "vocab_size", "block_count", "context_length",
                   "attention.head_count", "attention.head_count_kv", "attention.key_length",
                   "attention.value_length", "rope.dimension_count", "attention.sliding_window")
#: The real-number keys of a GGUF header (after ``<arch>.``), each a GGUF integer or float where given.
_GGUF_REAL_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor",
                   "attn_logit_softcapping", "final_logit_softcapping")


def _check_number(reader: GGUFFile, key: str, kinds: type | tuple[type, ...]) -> None:
    """Refuse a metadata value of another type than ``kinds`` (a bool is none), naming the key: read with ``int()`` or
    ``float()``, a string ``"8192"`` passed as the number it spells and a float ``8192.7`` as its integer part."""
    value = reader.fields.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        wanted = "an integer" if kinds is int else "a number"
        raise ModelLoadError(f"GGUF file {reader.path}: metadata {key} = {value!r:.80} is not {wanted} (a "
                             f"{type(value).__name__})")

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.")


def _check_index(reader: GGUFFile, config: ModelConfig) -> tuple[tuple[str, str], ...]:
    """Refuse a tensor index that disagrees with the config (see :func:`gguf_config`); the stored format of
    each projection and of the head (``"lm_head"``)."""
    arch = config.architecture
    index = {t.name: t for t in reader.tensors}
    _check_block_count(reader, arch, config.num_layers)
    largest = max((d for t in reader.tensors for d in t.shape), default=0)
    for key, value in ((f"{arch}.embedding_length", config.hidden_size),
                       (f"{arch}.feed_forward_length", config.intermediate_size),
                       (f"{arch}.vocab_size", config.vocab_size),
                       (f"{arch}.attention.head_count x key_length", config.q_size),
                       (f"{arch}.attention.head_count_kv x key_length", config.kv_size)):
        if value > largest:
            raise ModelLoadError(f"GGUF file {reader.path}: metadata {key} = {value} is larger than any of its "
                                 f"tensors (the largest dimension is {largest})")
    model = build_on_meta(config)
    params = dict(model.named_parameters())
    targets = build_targets(config, "gguf")
    for name, target in targets.items():
        tensor = index.get(name)
        if tensor is None:
            continue  # listed with the others below
        shape = params[target.param].shape
        expected = tuple(shape) if target.rows is None else (target.rows.stop - target.rows.start, *shape[1:])
        if tensor.shape != expected:
            raise ModelLoadError(f"GGUF tensor {name!r} ({tensor.format}) has shape {tensor.shape}, but the file's "
                                 f"metadata makes it {expected} (for parameter {target.param!r})")
    missing = sorted(set(targets) - set(index))
    if missing:
        raise ModelLoadError(f"GGUF file {reader.path} is missing {len(missing)} tensor(s): {_preview(missing)}")
    unexpected = [name for name in index if name not in targets and not _is_ignorable(name, config)]
    if unexpected:
        raise ModelLoadError(f"GGUF file {reader.path} has {len(unexpected)} unexpected tensor(s): "
                             f"{_preview(unexpected)}")
    head = next(name for name, p in params.items() if p is model.lm_head_weight)  # the family contract
    layers = _gguf_layers(reader, targets, head)
    formats = []
    for layer in (*layer_formats(config, None), *embedding_formats(config, None)):  # projections, "lm_head", the
        formats.append((layer, _stored_format(layers[layer][0])))  # embedding
    return tuple(formats)


def _stored_format(tensors: list[GGUFTensor]) -> str:
    """The stored format of a layer made of ``tensors`` (its row shards in order): their format where they share
    one, else a :func:`~asyncinfer.models.quant.mixed_format` of each one's format and rows."""
    kinds = {t.format for t in tensors}
    return kinds.pop() if len(kinds) == 1 else mixed_format((t.format, t.rows) for t in tensors)


def _check_block_count(reader: GGUFFile, arch: object, count: object) -> None:
    """Refuse a block count other than the layers the tensors hold: a model built for a wrong count would be that
    count's size. The count is read as gguf_model_config reads it (``int()``: a string or a float of the metadata
    too), so a Gemma file's per-layer pattern is never built for a count the tensors do not hold."""
    if count is None:
        return  # absent: gguf_model_config says so
    try:
        count = int(count)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return  # of no kind int() reads: gguf_model_config says so
    blocks = {int(m.group(1)) for t in reader.tensors if (m := _BLOCK_NAME.match(t.name))}
    held = max(blocks) + 1 if blocks else 0
    if count != held:
        raise ModelLoadError(f"GGUF file {reader.path}: metadata {arch}.block_count = {count}, but its "
                             f"tensors hold {held} layer(s)" + (f" (blk.0 ... blk.{held - 1})" if held else ""))


def _native_format(stored: tuple[tuple[str, str], ...]) -> str | None:
    """``ModelConfig.native_format`` of a file storing its projections in ``stored``: the block format of
    every projection where its head is in that format's head format (SmolLM2's: Q4_1 layers, a Q8_0 head);
    "native" where some projection or the head is in a format a kernel takes; None otherwise."""
    layers = {fmt for name, fmt in stored if name != "lm_head"}
    head = dict(stored).get("lm_head")
    if len(layers) == 1:
        (fmt,) = layers
        if BLOCK_HEAD_FORMAT.get(fmt, "") == head:
            return fmt
    kernel_parts = (part for fmt in layers for part, _ in mixed_parts(fmt))  # a mixed layer's parts count too
    return NATIVE if any(fmt in BLOCK_FORMATS for fmt in (*layers, head, *kernel_parts)) else None


def gguf_model_config(reader: GGUFFile) -> ModelConfig:
    """Build a ``ModelConfig`` from a GGUF file's metadata (and its tensor list)."""
    arch = _field(reader, "general.architecture")
    family = model_family(arch, what="GGUF architecture", gguf=True)
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    if num_heads < 1:  # before the head size's default divides by it
        raise ModelLoadError(f"GGUF metadata {arch}.attention.head_count = {num_heads} must be a positive int")
    key_length = _field(reader, f"{arch}.attention.key_length", None)
    if key_length is None and hidden % num_heads:  # the head size is then embedding_length / head_count, whole
        raise ModelLoadError(f"GGUF metadata {arch}.embedding_length = {hidden} is not a multiple of "
                             f"{arch}.attention.head_count = {num_heads} (and no {arch}.attention.key_length says "
                             "the head size)")
    head_dim = int(key_length if key_length is not None else hidden // num_heads)
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim > head_dim:
        raise ModelLoadError(f"GGUF metadata {arch}.rope.dimension_count = {rope_dim} must be at most the head size "
                             f"({head_dim})")
    if rope_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    value_dim = _field(reader, f"{arch}.attention.value_length", None)
    if value_dim is not None and int(value_dim) != head_dim:  # the attention reads values as wide as keys
        raise ModelLoadError(f"GGUF metadata {arch}.attention.value_length = {value_dim} differs from the key head size "
                             f"({head_dim}, {arch}.attention.key_length or embedding_length / head_count): value heads "
                             "of another width are not supported")
    experts = _field(reader, f"{arch}.expert_count", None)
    if isinstance(experts, int) and experts > 0:  # (a dense file may say 0) its feed-forwards would be read as one
        raise ModelLoadError(f"GGUF metadata {arch}.expert_count = {experts}: mixture-of-experts models are not "
                             "supported (asyncinfer runs dense feed-forward layers)")
    vocab = _field(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = int(tensors["token_embd.weight"].shape[0]) if "token_embd.weight" in tensors else len(
            _field(reader, "tokenizer.ggml.tokens")
        )
    eos = normalise_token_ids(_field(reader, "tokenizer.ggml.eos_token_id", None))
    eot = normalise_token_ids(_field(reader, "tokenizer.ggml.eot_token_id", None))
    num_layers = int(_field(reader, f"{arch}.block_count"))
    window, layer_types = _gguf_window(reader, arch, num_layers)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors, head_dim),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=family.qkv_bias,
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_ids=tuple(dict.fromkeys((*eos, *eot, *_gguf_token_ids(reader, family.gguf_eot_tokens)))),
        sliding_window=window,
        layer_types=layer_types,
        attn_logit_softcapping=_optional_float(_field(reader, f"{arch}.attn_logit_softcapping", None)),
        final_logit_softcapping=_optional_float(_field(reader, f"{arch}.final_logit_softcapping", None)),
        **_gguf_gemma_fields(reader, arch, family.name, num_layers, hidden, num_heads, head_dim),
    )


# llama.cpp's Gemma conventions, for files that do not state them (its loader hard-codes them):
# the sliding-window pattern (every 2nd layer full for Gemma 2, every 6th for Gemma 3) and the layer
# count of the 27B models, whose softmax scale is (hidden / heads) ** -0.5 instead of head_dim ** -0.5.
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_window(reader: GGUFFile, arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` from ``<arch>.attention.sliding_window`` and
    ``<arch>.attention.sliding_window_pattern`` (a period ``n``: every ``n``-th layer full, the others
    sliding, or one bool a layer: sliding or not). Gemma files without a pattern get llama.cpp's; other
    architectures' windows apply to every layer. A window of 0 is none."""
    window = _optional_int(_field(reader, f"{arch}.attention.sliding_window", None)) or None
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_SWA_PATTERN.get(arch))
    if pattern is None:
        return window, None
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                                 f"for {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        if period < 1:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.sliding_window_pattern={period} must be >= 1")
        sliding = [(i + 1) % period != 0 for i in range(num_layers)]
    types = tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding)
    return (window, types) if window is not None and any(sliding) else (None, types)


def _gguf_gemma_fields(reader: GGUFFile, arch: str, family: str, num_layers: int, hidden: int, num_heads: int,
                       head_dim: int) -> dict[str, Any]:
    """The ModelConfig fields only Gemma files set: the softmax scale (``<arch>.attention.scale`` where
    the file has it, else llama.cpp's rule), the sliding layers' rope base (``<arch>.rope.freq_base_swa``,
    else 10000 as llama.cpp takes for Gemma 3) and the norm offset (0: llama.cpp's converter stored the
    norm weights with Gemma's 1 added)."""
    if family not in _GEMMA_SWA_PATTERN:
        return {}
    scale = _field(reader, f"{arch}.attention.scale", None)
    if scale is not None:
        if not float(scale) > 0:  # 0 raised ZeroDivisionError; a negative one lost its sign
            raise ModelLoadError(f"GGUF metadata {arch}.attention.scale = {scale!r} must be > 0")
        scalar = float(scale) ** -2
    elif num_layers == _GEMMA_27B_LAYERS[family]:
        scalar = hidden / num_heads
    else:
        scalar = float(head_dim)
    swa_base = _field(reader, f"{arch}.rope.freq_base_swa", 10000.0 if family == "gemma3" else None)
    return {"query_pre_attn_scalar": scalar, "sliding_rope_theta": _optional_float(swa_base),
            "norm_weight_offset": 0.0}


def _gguf_token_ids(reader: GGUFFile, texts: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the tokens spelled ``texts`` in the file's vocabulary (those it has), in that order."""
    if not texts or "tokenizer.ggml.tokens" not in reader.fields:
        return ()
    tokens = reader.fields["tokenizer.ggml.tokens"]
    ids = {text: i for i, text in enumerate(tokens) if text in texts}
    return tuple(ids[text] for text in texts if text in ids)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _gguf_rope_scaling(reader: GGUFFile, arch: str, tensors: dict[str, Any], head_dim: int) -> dict[str, Any] | None:
    """Rope scaling from GGUF: linear from metadata; Llama 3.1's as explicit frequency factors; Phi-3's longrope
    from its two factor tensors (:func:`_gguf_longrope`)."""
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "longrope" or any(name in tensors for name in _LONGROPE_TENSORS.values()):
        return _gguf_longrope(reader, arch, tensors, kind, head_dim)
    has_factors = "rope_freqs.weight" in tensors
    if kind not in ("none", "linear") or (kind == "linear" and has_factors):
        said = "'linear' with a rope_freqs.weight tensor" if kind == "linear" else repr(kind)
        raise ModelLoadError(f"unsupported GGUF rope scaling {said}: a GGUF's {arch}.rope.scaling.type may be none, "
                             "linear (without rope_freqs.weight), or longrope (Phi-3's factor tensors); Llama 3.1's "
                             "scaling is its rope_freqs.weight tensor with no type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    if has_factors:
        # llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors.
        factors = reader.dequantize(tensors["rope_freqs.weight"]).reshape(-1)
        return {"rope_type": "freq_factors", "factors": tuple(factors.tolist())}
    return None


# Longrope's factor lists as llama.cpp's converter writes them: one float tensor each, head_dim / 2 divisors.
_LONGROPE_TENSORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}


def _gguf_longrope(reader: GGUFFile, arch: str, tensors: dict[str, Any], kind: object, head_dim: int) -> dict[str, Any]:
    """Phi-3's longrope ("su") as llama.cpp writes it: ``rope_factors_short`` / ``rope_factors_long`` tensors
    (``head_dim / 2`` floats each, checked from the header before they are read), the original context in
    ``<arch>.rope.scaling.original_context_length`` and the attention factor in ``<arch>.rope.scaling.attn_factor``.
    Where the file is silent, what llama.cpp assumes: the original context is the model's (the long factors
    never apply) and the attention factor is 1. The values themselves are checked by ``ModelConfig``."""
    if kind not in ("none", "longrope") or "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"GGUF file {reader.path}: longrope factor tensors with {arch}.rope.scaling.type="
                             f"{kind!r}{' and rope_freqs.weight' if 'rope_freqs.weight' in tensors else ''}: "
                             "one rope scaling a model")
    for key, name in _LONGROPE_TENSORS.items():  # both checked from the header before either is read
        tensor = tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"GGUF file {reader.path} has no {name} (longrope's {key}; it needs "
                                 f"{' and '.join(_LONGROPE_TENSORS.values())})")
        if tensor.shape != (head_dim // 2,) or tensor.format not in ("float32", "float16", "bfloat16"):
            raise ModelLoadError(f"GGUF tensor {name} is {tensor.type_name} {list(tensor.shape)}, expected a float "
                                 f"tensor of head_dim/2={head_dim // 2} values (longrope's {key})")
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, name in _LONGROPE_TENSORS.items():
        scaling[key] = tuple(reader.dequantize(tensors[name]).reshape(-1).tolist())
    context = _field(reader, f"{arch}.context_length")
    for field, key, default in (("original_max_position_embeddings", "original_context_length", context),
                                ("attention_factor", "attn_factor", 1.0)):
        value = _field(reader, f"{arch}.rope.scaling.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"GGUF metadata {arch}.rope.scaling.{key} must be a number, got {value!r}")
        scaling[field] = value
    return scaling


def _iter_gguf(reader: GGUFFile, config: ModelConfig, dtype: torch.dtype,
               skip: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUF tensors one at a time as CPU tensors in HF layout (``skip``: names already read elsewhere).

    A float tensor stored in ``dtype`` and used as it lies is a view of the map (no copy); any other is a new
    float32 tensor, whose pages of the file are dropped from the process once it has been used.
    """
    for t in reader.tensors:
        if t.name in skip:
            continue
        heads = _permuted_heads(t.name, config)
        if heads is None and t.format == str(dtype).removeprefix("torch."):
            yield t.name, reader.view(t)  # adopted as the parameter: the file's bytes, in place
            continue
        tensor = reader.dequantize(t)  # [rows, cols], slowest dimension first
        if heads is not None:
            tensor = torch.from_numpy(_unpermute_rope_rows(tensor.numpy(), heads))
        yield t.name, tensor
        reader.release(t)


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation so rope's rotate_half convention holds.

    llama.cpp's converter interleaves each head's two rope halves (rows
    ``[a0..a_{n-1}, b0..b_{n-1}]`` become ``[a0, b0, a1, b1, ...]``) for its
    GPT-J-style rope; this puts the halves back one after the other (in numpy:
    one thread, see :func:`_copy`).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [heads, D/2, 2, cols]
        .swapaxes(1, 2)  # [heads, 2, D/2, cols]
        .reshape(weight.shape)  # [rows, cols], a new contiguous array
    )


# ---- the GGUF tokenizer, built once ----------------------------------------

_STAMP = "asyncinfer-tokenizer.json"


def gguf_tokenizer(path: Path, header: GGUFFile | None = None,
                   vocab_size: int | None = None) -> PreTrainedTokenizerBase | CachedTokenizer:
    """The tokenizer of a GGUF file: built by transformers from the metadata once, then cached.

    Building it (transformers parses the whole GGUF again and converts the
    vocabulary) takes ~5-20 s on a 2-core CPU; the cached ``tokenizer.json`` loads in
    well under a second. The cache is a directory next to the default model (see
    :func:`asyncinfer.model_source.tokenizer_cache_dir`), stamped with the file's size
    and modification time, a digest of its header (the metadata the tokenizer is built from: a file rewritten at
    the same size and time, by ``cp -p`` or ``rsync -a``, kept its old tokenizer and chat template) and the
    transformers version; a stale or unreadable one is rebuilt. The build runs in a separate process bounded in
    memory and CPU time in proportion to ``vocab_size`` (:mod:`asyncinfer.models.tokenizer_build`), from the file's
    metadata alone, and saves the cache (where the cache cannot be written, a private directory this load reads the
    tokenizer from and removes): this process never builds it from the file. The cache loads as a
    :class:`~asyncinfer.models.tokenizer.CachedTokenizer` (the ``tokenizers`` library and the chat template,
    without importing transformers) where its configuration is the plain one
    transformers writes for a GGUF vocabulary, else as the transformers class that built it.

    Raises:
        ModelLoadError: transformers cannot build a tokenizer from the file, or its build exceeds its bounds or
            holds more tokens than ``vocab_size``.
    """
    from asyncinfer.model_source import tokenizer_cache_dir

    cache = tokenizer_cache_dir(path)
    stamp = _tokenizer_stamp(path, header if header is not None else GGUFFile(path))
    cached = _cached_tokenizer(cache, stamp)
    if cached is not None:
        with contextlib.suppress(OSError):  # used now: the last to be pruned (_prune_caches)
            _used_now(cache / _STAMP)
        return cached
    say(f"building the tokenizer of {path.name} once (it is cached in {cache})")
    # the bounded build saves the tokenizer where the cache is staged, or (no cache can be written) in a private
    # directory this load reads it from: this process never builds it from the file itself
    staged = _staging_dir(cache) or tokenizer_build.fresh_dir("asyncinfer-gguf-tokenizer-")
    try:
        report = tokenizer_build.check_build(path.parent, gguf_file=path.name, vocab_size=vocab_size, save_to=staged)
        stamped = {**stamp, "class": report.tokenizer_class}
        if staged.parent == cache.parent and _commit_cache(staged, cache, stamped):
            loaded = _cached_tokenizer(cache, stamp)
            _prune_caches(cache.parent, keep=cache)
        else:
            (staged / _STAMP).write_text(json.dumps(stamped))
            loaded = _cached_tokenizer(staged, stamp)
    except tokenizer_build.BuildFailed as exc:
        said = f"the tokenizers library panicked on its vocabulary ({exc.said})" if exc.panicked else exc.said
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {said}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read the tokenizer built from GGUF file {path} (saved in {staged}): "
                             f"{exc}") from exc
    finally:
        _discard(staged)  # (moved into the cache's place where it could be)
    if loaded is None:
        raise ModelLoadError(f"cannot load the tokenizer built from GGUF file {path}: its saved files ({cache}) "
                             "could not be read back")
    return loaded


def _tokenizer_stamp(path: Path, header: GGUFFile) -> dict[str, Any]:
    info = path.stat()
    return {"gguf": str(path.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns,
            "header": header.header_digest(),
            "transformers": importlib.metadata.version("transformers")}  # (importing it costs ~1 s of CPU)


def _cached_tokenizer(cache: Path, stamp: dict[str, Any]) -> PreTrainedTokenizerBase | CachedTokenizer | None:
    """The cached tokenizer if its stamp matches: a :class:`CachedTokenizer` where it reproduces the cache
    exactly, else loaded with the class that built it (importing only that class, not ``AutoTokenizer``'s
    registry, saves ~1 s)."""
    try:
        saved = json.loads((cache / _STAMP).read_text())
        if {k: saved.get(k) for k in stamp} != stamp:
            return None
        light = load_cached(cache)
        if light is not None:
            return light
        module, _, name = str(saved["class"]).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return cls.from_pretrained(cache)
    except (OSError, ValueError, KeyError, ImportError, AttributeError):
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged cache can fail in any way: rebuild it
        logger.warning("the cached tokenizer in %s cannot be loaded (%s); rebuilding it", cache, exc)
        return None


#: How many GGUF files' cached tokenizers the cache directory's ``tokenizers/`` keeps (each some MB, one per file's
#: path: the least recently used are removed past it; a file moved or loaded from another path builds its own).
KEPT_TOKENIZER_CACHES = 64


def _used_now(stamp: Path) -> None:
    """Set a cache's stamp's times to now, read from the clock itself: the times a write or a bare ``os.utime``
    sets may come from the kernel's coarse clock, a few ms behind a finer time another file got just before, and
    _prune_caches would then take the later use for the earlier."""
    now = time.time_ns()
    os.utime(stamp, ns=(now, now))


def _prune_caches(folder: Path, keep: Path) -> None:
    """Remove the cached tokenizers of ``folder`` (``<cache>/tokenizers/``: each a directory with its stamp) past
    the :data:`KEPT_TOKENIZER_CACHES` most recently used, never ``keep`` (failures are only logged)."""
    try:
        caches = [entry for entry in folder.iterdir()
                  if not entry.name.startswith(".") and (entry / _STAMP).is_file() and entry != keep]
        caches.sort(key=lambda entry: (entry / _STAMP).stat().st_mtime_ns, reverse=True)
    except OSError as exc:
        logger.warning("could not prune the cached tokenizers in %s: %s", folder, exc)
        return
    for old in caches[KEPT_TOKENIZER_CACHES - 1:]:
        shutil.rmtree(old, ignore_errors=True)


#: A staging directory older than this is one a load left when its process was killed: removed by the next.
_STALE_STAGING_S = 3600


def _staging_dir(cache: Path) -> Path | None:
    """A new empty directory beside ``cache`` to write it in (staging directories an hour old, which killed loads
    left, removed first); None (logged) where none can be made."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tokenizer_build.remove_stale(cache.parent, ".tokenizer-", _STALE_STAGING_S)
        return Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=cache.parent))
    except OSError as exc:
        logger.warning("could not cache the tokenizer in %s: %s", cache, exc)
        return None


def _commit_cache(staged: Path, cache: Path, stamped: dict[str, Any]) -> bool:
    """Stamp the tokenizer saved in ``staged`` (``stamped``: the stamp and its class) and put it in ``cache``'s place
    at once; whether it was (a failure is only logged: the staged directory is left for the caller to read)."""
    try:
        (staged / _STAMP).write_text(json.dumps(stamped))
        _used_now(staged / _STAMP)
        if cache.exists():
            shutil.rmtree(cache)
        os.replace(staged, cache)
        return True
    except OSError as exc:
        logger.warning("could not cache the tokenizer in %s: %s", cache, exc)
        return False


def _discard(staged: Path | None) -> None:
    if staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
