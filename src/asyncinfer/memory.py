"""Memory planning: how many KV blocks fit, computed rather than guessed.

The bytes of one block come from the model version's :class:`KVCacheSpec`
(``spec.block_bytes``; the layout is defined there and nowhere else). The
budget is, in this order:

- ``kv_cache_memory``: an explicit byte count;
- ``kv_cache_fraction``: a fraction of the memory that is free after the weights
  (available RAM on CPU, free device memory on CUDA) minus an activation reserve;
- by default, sized from the workload on the CPU: room for
  ``min(max_num_seqs, DEFAULT_KV_FULL_REQUESTS)`` requests of ``max_model_len``
  tokens, each in whole blocks (:func:`default_kv_tokens`), never more than :data:`DEFAULT_KV_FRACTION`
  of the free memory; on CUDA (memory that serves nothing else) that fraction.

Before anything is loaded, :func:`check_weights_fit` refuses weights larger
than the memory available, naming the numbers and what would fit.

:func:`plan_kv_cache` is the arithmetic over a spec; :func:`plan_for_engine`
feeds it the engine options. The spec is passed *alongside* the plan, not
stored in it: the caller that builds the spec (the engine's start-up path)
hands the same object to the planner, the KV tensors, the block manager and
the runner. :func:`plan_memory` runs the planner *before* anything is loaded,
from the model's config alone (the weights counted from the shapes by
``models.quant.weight_bytes``, int8 included, as start-up counts them), which
is what ``AsyncEngine.plan_memory`` exposes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.config import MAX_BYTES
from asyncinfer.errors import ConfigurationError, InvalidParameterError
from asyncinfer.models.layers import rope_table_bytes
from asyncinfer.models.quant import default_skip, smaller_cpu_formats, weight_bytes

if TYPE_CHECKING:
    from asyncinfer.config import EngineConfig
    from asyncinfer.models.config import ModelConfig

GiB = 1024**3
MiB = 1024**2

#: The CPU default KV cache holds this many ``max_model_len`` requests (fewer if ``max_num_seqs`` is smaller).
DEFAULT_KV_FULL_REQUESTS = 4
#: The default budget never takes more than this fraction of the memory free after the weights.
DEFAULT_KV_FRACTION = 0.25


def format_bytes(n: int) -> str:
    """``n`` bytes as GiB (1 GiB and more) or MiB, one decimal."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def format_bytes_apart(need: int, have: int) -> tuple[str, str]:
    """Two sizes as :func:`format_bytes` writes them, with their exact byte counts where its rounding would
    write them alike ("1.0 MiB ... but 1.0 MiB are available" read as no shortfall)."""
    shown = format_bytes(need), format_bytes(have)
    if shown[0] != shown[1]:
        return shown
    return f"{shown[0]} ({need:,} bytes)", f"{shown[1]} ({have:,} bytes)"


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device`` without evicting anything."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class MemoryPlan:
    """The numbers the engine starts with; ``describe()`` prints them."""

    weight_bytes: int
    block_bytes: int
    num_blocks: int
    block_size: int
    kv_budget_bytes: int
    activation_reserve: int
    max_model_len: int

    @property
    def kv_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def kv_token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"weights {self.weight_bytes / MiB:.1f} MiB, KV cache {self.kv_bytes / MiB:.1f} MiB "
            f"({self.num_blocks} blocks x {self.block_size} tokens = {self.kv_token_capacity} tokens, "
            f"{self.block_bytes / 1024:.1f} KiB/block), activation reserve "
            f"{self.activation_reserve / MiB:.0f} MiB, max_model_len {self.max_model_len}"
        )


def plan_kv_cache(
    spec: KVCacheSpec,
    *,
    max_model_len: int,
    weight_bytes: int,
    kv_cache_memory: int | None,
    kv_cache_fraction: float | None,
    activation_reserve: int,
    free_bytes: int,
    default_tokens: int | None = None,
) -> MemoryPlan:
    """Size the KV cache of ``spec``; refuse, with numbers, a plan where one max-length request cannot fit.

    ``free_bytes`` is the memory free *after* the weights were placed. With neither
    ``kv_cache_memory`` nor ``kv_cache_fraction``, the budget is room for
    ``default_tokens`` tokens (None: no such bound), at most :data:`DEFAULT_KV_FRACTION`
    of the free memory less the reserve.

    Raises:
        ConfigurationError: ``kv_cache_memory`` exceeds ``free_bytes``, or the budget
            holds fewer blocks than one ``max_model_len`` request needs.
    """
    block_bytes = spec.block_bytes
    block_size = spec.block_size
    if kv_cache_memory is not None:
        budget = kv_cache_memory
        if budget > free_bytes:
            raise ConfigurationError(
                f"kv_cache_memory={budget} bytes ({format_bytes(budget)}) exceeds the "
                f"{format_bytes(free_bytes)} free after loading {format_bytes(weight_bytes)} of weights; "
                "lower kv_cache_memory"
            )
    else:
        fraction = DEFAULT_KV_FRACTION if kv_cache_fraction is None else kv_cache_fraction
        budget = int(max(0, free_bytes - activation_reserve) * fraction)
        if kv_cache_fraction is None and default_tokens is not None:
            budget = min(budget, -(-default_tokens // block_size) * block_bytes)
    num_blocks = budget // block_bytes
    need_blocks = -(-max_model_len // block_size)
    if num_blocks < need_blocks:
        raise ConfigurationError(
            f"the KV cache holds {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens "
            f"({format_bytes(budget)} at {block_bytes} bytes/block), but one request of max_model_len="
            f"{max_model_len} needs {need_blocks} blocks ({format_bytes(need_blocks * block_bytes)}). "
            f"Raise kv_cache_memory / kv_cache_fraction or lower max_model_len."
            + (f" Only {format_bytes(max(0, free_bytes - activation_reserve))} of the {format_bytes(free_bytes)} free "
               f"after the weights is outside activation_reserve ({format_bytes(activation_reserve)}): lower "
               "activation_reserve, or give kv_cache_memory."
               if kv_cache_memory is None and free_bytes - activation_reserve < need_blocks * block_bytes else "")
        )
    return MemoryPlan(
        weight_bytes=weight_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_budget_bytes=budget,
        activation_reserve=activation_reserve,
        max_model_len=max_model_len,
    )


# --------------------------------------------------------------------------- before loading


def read_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model's :class:`ModelConfig` from its metadata only (config.json or GGUF header)."""
    from asyncinfer.models.loader import read_model_config as read

    return read(path)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """``max_model_len``, defaulting to the model's context length (checked against it)."""
    limit = model_config.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:
        raise InvalidParameterError("max_model_len", max_model_len, f"at most the model's context length {limit}")
    return max_model_len


def default_kv_tokens(config: EngineConfig, max_model_len: int) -> int | None:
    """The default KV capacity in tokens: ``min(max_num_seqs, DEFAULT_KV_FULL_REQUESTS)`` requests of
    ``max_model_len`` on the CPU, each rounded up to whole blocks (a request of 100 tokens holds 7 blocks of
    16, so 4 of them need 28 blocks, not the 25 that 400 tokens fill); None on CUDA (the default fraction of
    free device memory)."""
    if config.device.type != "cpu":
        return None
    per_request = -(-max_model_len // config.block_size) * config.block_size
    return min(config.max_num_seqs, DEFAULT_KV_FULL_REQUESTS) * per_request


def plan_for_engine(
    config: EngineConfig, model_config: ModelConfig, spec: KVCacheSpec, *, weight_bytes: int, free_bytes: int
) -> MemoryPlan:
    """:func:`plan_kv_cache` of ``spec`` with the engine options; ``free_bytes`` is what is free after the weights.

    Raises:
        InvalidParameterError: ``max_model_len`` beyond the model's context length.
        ConfigurationError: as :func:`plan_kv_cache`.
    """
    max_model_len = resolve_max_model_len(config, model_config)
    return plan_kv_cache(
        spec,
        max_model_len=max_model_len,
        weight_bytes=weight_bytes,
        kv_cache_memory=config.kv_cache_memory,
        kv_cache_fraction=config.kv_cache_fraction,
        activation_reserve=config.activation_reserve,
        free_bytes=free_bytes,
        default_tokens=default_kv_tokens(config, max_model_len),
    )


def check_rope_fits(model_config: ModelConfig, config: EngineConfig, weights: int, available: int) -> None:
    """Refuse, before loading, a model whose rope tables (a row a position of its context,
    :func:`~asyncinfer.models.layers.rope_table_bytes`) do not fit beside its weights: a context length that no
    memory holds (a header's 2**31 - 1) was only found as the tables were allocated, tens of GB at once.

    Raises:
        ConfigurationError: ``weights`` and the tables' peak past ``available``, naming ``max_position_embeddings``.
    """
    rope = rope_table_bytes(model_config)
    if weights + rope <= available:
        return
    raise ConfigurationError(
        f"the model does not fit: its rope tables, a row for each of its max_position_embeddings = "
        f"{model_config.max_position_embeddings} positions, need {format_bytes(rope)} beside "
        f"{format_bytes(weights)} of weights, but {format_bytes(available)} are available on {config.device} "
        "(whatever max_model_len the engine runs with); a model with a shorter context would fit")


def check_weights_fit(model_config: ModelConfig, config: EngineConfig, weights: int, available: int) -> None:
    """Refuse, before loading, weights larger than the memory available.

    The message names the cause, the numbers and what would fit instead: float16 or
    int8 weights (CPU, float32) when they and the activation reserve would fit, and a
    smaller model. (Weights that fit but leave too little for the KV cache are
    :func:`plan_kv_cache`'s refusal.)

    Raises:
        ConfigurationError: ``weights > available``.
    """
    if weights <= available:
        return
    dtype = str(config.dtype).removeprefix("torch.")
    if config.device.type == "cpu" and config.quantization is not None:
        dtype = f"{config.quantization} weights"
    fixes = []
    if config.device.type == "cpu" and config.dtype == torch.float32:
        for method in smaller_cpu_formats(config.quantization):
            smaller = weight_bytes(model_config, config.dtype_bytes, method, default_skip(method))
            if smaller + config.activation_reserve <= available:
                fixes.append(f"quantization='{method}' ({format_bytes(smaller)} of weights)")
    fixes.append("a smaller model")
    need, have = format_bytes_apart(weights, available)
    raise ConfigurationError(
        f"the model does not fit: its weights need {need} ({dtype}) but "
        f"{have} are available on {config.device}; try {' or '.join(fixes)}"
    )


def check_available_bytes(available: Any) -> int | None:
    """``available_bytes`` (of :func:`plan_memory`, ``AsyncEngine.plan_memory``, ``swap_model``, ``add_model``) as
    the plain ``int`` it holds (an ``int`` subclass's comparisons may lie), or None; InvalidParameterError naming it
    for anything else (a bool, a float, a negative count)."""
    from asyncinfer.plain import plain_value

    available = plain_value(available)
    if available is not None and (isinstance(available, bool) or not isinstance(available, int) or available < 0
                                  or available > MAX_BYTES):
        raise InvalidParameterError("available_bytes", available, f"a byte count in [0, {MAX_BYTES}], or None")
    return available


def plan_memory(
    model: str | os.PathLike[str] | ModelConfig | None = None,
    *,
    available_bytes: int | None = None,
    **options: Any,
) -> MemoryPlan:
    """Plan the KV cache without loading weights: what ``from_pretrained`` would allocate.

    ``model``: a model directory, a ``.gguf`` file, a :class:`ModelConfig`, or
    ``None`` for the default model. ``options``: the engine options
    (``dtype``, ``device``, ``block_size``, ``kv_cache_memory``, ``kv_cache_fraction``,
    ``activation_reserve``, ``max_model_len``, ``quantization``, ...). ``available_bytes``:
    memory free *before* loading (default: measured now on the device); the weights,
    counted from the config as they will be loaded (int8 included), are subtracted from it.

    Raises:
        InvalidParameterError: an unknown option or an out-of-range value (``available_bytes`` included: an ``int``
            >= 0 or None).
        ModelLoadError: the model's config cannot be read.
        ConfigurationError: the weights do not fit (:func:`check_weights_fit`), or the KV
            cache cannot hold one ``max_model_len`` request.
    """
    from asyncinfer.config import EngineConfig, for_model
    from asyncinfer.models.config import ModelConfig

    available_bytes = check_available_bytes(available_bytes)
    config = EngineConfig.from_options(options)
    if isinstance(model, ModelConfig):
        model_config = model
    else:
        from asyncinfer.model_source import resolve_model

        model_config = read_model_config(resolve_model(model))
    config = for_model(config, options, model_config)  # "auto": the file's own format where it runs
    return plan_resolved(model_config, config, available_bytes)


def plan_resolved(model_config: ModelConfig, config: EngineConfig, available_bytes: int | None = None) -> MemoryPlan:
    """:func:`plan_memory` for a config whose weight format is already resolved for the model
    (:func:`asyncinfer.config.for_model`): the loader plans with the config it loads with, without resolving
    (and warning about) ``quantization="auto"`` a second time."""
    # GGUF weights are dequantised at load, so the file size is no guide: count from the shapes.
    weights = weight_bytes(model_config, config.dtype_bytes, config.quantization, config.quantization_skip,
                           config.device)
    if available_bytes is None:
        available_bytes = available_memory(config.device)
    check_weights_fit(model_config, config, weights, available_bytes)
    check_rope_fits(model_config, config, weights, available_bytes)
    free_bytes = max(0, available_bytes - weights)
    spec = KVCacheSpec.from_model_config(model_config, block_size=config.block_size, dtype=config.dtype,
                                         device=config.device)
    plan = plan_for_engine(config, model_config, spec, weight_bytes=weights, free_bytes=free_bytes)
    check_batched_tokens(config, plan.max_model_len)
    return plan


def check_batched_tokens(config: EngineConfig, max_model_len: int) -> None:
    """Refuse a step budget that cannot hold a whole prompt when prompts are not split into chunks: checked with
    the plan (``asyncinfer serve`` prints it before loading), so the refusal comes before any weight is read.

    Raises:
        InvalidParameterError: ``max_num_batched_tokens`` below ``max_model_len`` with chunked prefill off.
    """
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise InvalidParameterError(
            "max_num_batched_tokens",
            config.max_num_batched_tokens,
            f">= max_model_len ({max_model_len}) while chunked prefill is off (a prompt must fit one step); or "
            "leave chunked prefill on",
        )
