"""Loading: the one path from a model name to something the engine serves.

``from_pretrained``, ``swap_model`` and ``add_model`` all call :func:`load`:

    resolve the model -> options validated -> config read, memory planned (refuse early) ->
    element-wise functions chosen (compiled with torch_compile=True) -> model built with them,
    weights (+ tokenizer, checked) -> weight format (int8) -> memory plan with what is
    free now -> KV tensors, scheduler, sampler -> core -> warm-up

A generator becomes a :class:`ModelVersion` (its own core, KV cache and prefix
cache); a BERT-family sentence encoder becomes an :class:`EmbeddingBatcher`.
Everything here runs on a thread of its own that ends with the load (see
:mod:`asyncinfer.threads`) and touches nothing the engine thread uses.

The fit checks (:func:`generator_shortfall`, :func:`embedder_shortfall`) and
:func:`plan_model_memory` read only the model's config, so they answer before
anything is loaded.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import time
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.config import EngineConfig, for_model
from asyncinfer.core import EngineCore, StepStats, default_eos_ids
from asyncinfer.embedding import (
    EmbeddingBatcher,
    EmbeddingConfig,
    EmbeddingPlan,
    apply_max_seq_len,
    plan_embedding,
)
from asyncinfer.errors import (
    AsyncInferError,
    ConfigurationError,
    InvalidParameterError,
    ModelLoadError,
    SwapError,
    exception_text,
    is_native_panic,
)
from asyncinfer.grammar import GrammarCompiler
from asyncinfer.holder import ModelVersion, idle_backoff
from asyncinfer.memory import (
    MemoryPlan,
    MiB,
    available_memory,
    check_available_bytes,
    check_batched_tokens,
    plan_for_engine,
    plan_memory,
    plan_resolved,
    resolve_max_model_len,
)
from asyncinfer.model_source import DEFAULT_MODEL_NAME, model_text, resolve_model
from asyncinfer.models import LoadedModel, ModelConfig
from asyncinfer.models.decode_backends import KernelDecode, kernel_decode_blocker, select_decode_backend
from asyncinfer.models.encoder import is_encoder_dir, load_encoder, read_encoder_config
from asyncinfer.models.layers import EAGER_OPS
from asyncinfer.models.loader import open_checkpoint
from asyncinfer.models.quant import (
    BLOCK_FORMATS,
    NATIVE,
    BlockEmbedding,
    BlockLinear,
    MixedBlockLinear,
    WeightFormat,
    apply_weight_format,
    layer_formats,
    mixed_parts,
    native_fallback,
    weight_bytes,
)
from asyncinfer.models.torch_compile import compile_elementwise_ops
from asyncinfer.outputs import CoreOutput
from asyncinfer.request import Request
from asyncinfer.runner import ModelRunner
from asyncinfer.sampler import Sampler
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers.base import Scheduler, SchedulerConfig
from asyncinfer.schedulers.registry import (
    builtin_schedulers,
    check_scheduler_options,
    create_scheduler,
    resolve_scheduler,
)
from asyncinfer.step import ENDS_ENGINE
from asyncinfer.threads import run_on_own_thread

logger = logging.getLogger("asyncinfer")

ModelRef = str | os.PathLike[str] | None


def load(
    model: ModelRef,
    options: dict[str, Any],
    *,
    version_id: int,
    kind: str | None = None,
    error: type[ModelLoadError] = ModelLoadError,
    what: str | None = None,
) -> ModelVersion | EmbeddingBatcher:
    """Load, check and warm up ``model`` with engine ``options``.

    ``kind``: "generate" or "embed" to insist on one kind (None: whatever the
    model is). ``error``: the class a failed load is raised as (the cause is
    chained); ``what`` names the operation in its message.

    Raises:
        InvalidParameterError: a bad option, or a model of the wrong ``kind``.
        ConfigurationError: the options cannot work together (e.g. the KV cache is too small).
        ModelLoadError (``error``): the model cannot be found, loaded, checked or warmed up.
    """
    _warn_if_on_a_loop()
    # On a thread that ends with the load: the torch work leaves no OpenMP team behind to slow
    # the engine thread's steps (see asyncinfer.threads).
    loaded = run_on_own_thread("asyncinfer-load", _load, model, options, version_id=version_id, kind=kind,
                               error=error, what=what)
    _set_threads(loaded.config.num_threads)  # on the caller's thread too (torch's count is per thread there)
    return loaded


def _load(
    model: ModelRef,
    options: dict[str, Any],
    *,
    version_id: int,
    kind: str | None,
    error: type[ModelLoadError],
    what: str | None,
) -> ModelVersion | EmbeddingBatcher:
    default = what is None and model is None  # named as the default model: the user never typed a name
    named = os.environ.get("ASYNCINFER_MODEL") or DEFAULT_MODEL_NAME  # what model=None loads
    path_or_error: Path | ModelLoadError
    try:
        path_or_error = resolve_model(model)  # checks model's type before anything formats it
    except ModelLoadError as exc:
        path_or_error = exc
    what = what or (f"loading the default model ({named})" if default else f"loading {model_text(model)!r}")
    if isinstance(path_or_error, ModelLoadError):
        raise error(f"{what} failed: {path_or_error}") from path_or_error
    path = path_or_error
    if default:
        what = f"loading the default model ({path})"
    if is_encoder_dir(path):
        if kind == "generate":
            raise InvalidParameterError("model", model_text(model), "a generator (this is a sentence encoder)")
        config = EmbeddingConfig.from_options(options)
        _set_threads(config.num_threads)
        return load_embedder(path, config, error=error, what=what)
    if kind == "embed":
        raise InvalidParameterError("model", model_text(model), "a sentence encoder (this is a generator)")
    config = EngineConfig.from_options(options)
    check_scheduler_options(config.scheduler, config.scheduler_options)  # refused before any weight is read
    _set_threads(config.num_threads)
    return load_generator(path, config, options, version_id=version_id, error=error, what=what)


def _warn_if_on_a_loop() -> None:
    """Loading on an event loop's own thread stalls that loop for the whole load (seconds)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    logger.warning("a model is loading on the event loop's thread, which stalls the loop for the whole load: "
                   "use 'await AsyncEngine.load(...)' (a worker thread) instead of from_pretrained()")


def _set_threads(num_threads: int | None) -> None:
    if num_threads is not None:
        torch.set_num_threads(num_threads)


def load_generator(
    path: Path,
    config: EngineConfig,
    options: dict[str, Any],
    *,
    version_id: int,
    error: type[ModelLoadError] = ModelLoadError,
    what: str = "loading a model",
) -> ModelVersion:
    """Plan its memory from the config, then load its weights and build its core; a warmed-up :class:`ModelVersion`.

    The plan refuses (``ConfigurationError``, with the numbers) before any weight is read.
    """
    try:
        checkpoint = open_checkpoint(path)
        config = for_model(config, options, checkpoint.config)  # "auto": the file's own format where it runs
        check_builtin_scheduler(config, plan_resolved(checkpoint.config, config))  # refused before any weight is read
        ops, compile_seconds = EAGER_OPS, None  # the element-wise functions the model is built with
        if config.torch_compile:
            ops, compile_seconds = compile_elementwise_ops(checkpoint.config, config.device, config.dtype)
        loaded = checkpoint.load(config.dtype, config.device, ops=ops, weight_format=WeightFormat(
            config.quantization, config.quantization_skip, config.pack_weights, config.activation_dtype))  # a GGUF's layers built as read
        check_tokenizer(loaded)
        plan, core = build_core(loaded, config, compile_seconds=compile_seconds)
        warm_up(core, config.stall_timeout)
    except (InvalidParameterError, ConfigurationError):
        raise
    except Exception as exc:
        raise error(f"{what} failed: {exc}") from exc
    return ModelVersion(
        version_id=version_id,
        source=loaded.source,
        path=str(path),
        config=config,
        options=dict(options),
        model_config=loaded.config,
        tokenizer=loaded.tokenizer,
        plan=plan,
        core=core,
    )


def load_embedder(
    path: Path, config: EmbeddingConfig, *, error: type[ModelLoadError] = ModelLoadError, what: str = "loading"
) -> EmbeddingBatcher:
    """Load, check and warm up an embedding model."""
    try:
        encoder = load_encoder(path, config.dtype, config.device)
        encoder.config = apply_max_seq_len(encoder.config, config)
        try:
            encoder.encode(["warm-up"])
        except InvalidParameterError as exc:  # its tokenizer cannot encode a plain word: the model files' fault
            raise ValueError(f"its tokenizer cannot encode the warm-up text ({exc})") from None
    except InvalidParameterError:
        raise
    except Exception as exc:
        raise error(f"{what} failed: {exc}") from exc
    return EmbeddingBatcher(encoder, config)


TOKENIZER_PROBE_TEXT = "hello world"
"""A plain text every working tokenizer encodes to at least one token (see :func:`check_tokenizer`)."""


def check_tokenizer(loaded: LoadedModel) -> None:
    """Reject a tokenizer that produces ids the model has no embedding for; warn about one that drops text.

    A tokenizer that encodes :data:`TOKENIZER_PROBE_TEXT` to no token at all (its own special tokens left
    out) would send every text prompt to the model as its special tokens alone: a vocabulary the
    tokenizer's type cannot read (transformers builds a GGUF file's tokenizer by its architecture, so a
    ``qwen2`` file with a SentencePiece vocabulary gets a byte-level BPE that matches none of its tokens).
    The model still serves token-id prompts, so this is a warning, not a refusal."""
    tokenizer = loaded.tokenizer
    if tokenizer is not None and len(tokenizer) > loaded.config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {loaded.config.vocab_size}"
        )
    if tokenizer is not None and _encodes_nothing(tokenizer):
        logger.warning(
            "the tokenizer of %s (%s) encodes the text %r to no token: every text prompt would reach the model as "
            "its special tokens alone. Its vocabulary does not match its type (a GGUF file's tokenizer is built by "
            "its architecture: tokenizer.ggml.model must be the one that architecture uses); send token ids, or "
            "use a file whose tokenizer reads text (docs/models_and_embeddings.md)",
            loaded.source, type(tokenizer).__name__, TOKENIZER_PROBE_TEXT)


def _encodes_nothing(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` encodes :data:`TOKENIZER_PROBE_TEXT` to no token. A tokenizer that fails on the text
    (raises, or its Rust code panics) is not this case: each text request then fails with the prompt's own typed
    error, and the model still serves token ids (tests/server/test_fresh_pass15.py)."""
    try:
        return not tokenizer.encode(TOKENIZER_PROBE_TEXT, add_special_tokens=False)
    except BaseException as exc:
        if isinstance(exc, Exception) or is_native_panic(exc):
            return False
        raise


def build_core(loaded: LoadedModel, config: EngineConfig, *,
               compile_seconds: float | None = None) -> tuple[MemoryPlan, EngineCore]:
    """Apply the weight format, plan memory, and wire the runner, KV cache, scheduler and sampler.

    ``compile_seconds``: the load's ``torch.compile`` time when the model was built with the compiled
    element-wise functions (``torch_compile=True``), reported by ``model_info()``."""
    mc = loaded.config
    max_model_len = resolve_max_model_len(config, mc)
    check_batched_tokens(config, max_model_len)
    if config.device.type == "cpu":  # on CUDA the formats are dtypes: the weights are loaded in it
        if loaded.weight_format is None:  # not built in its format as it was read (a Hugging Face directory)
            apply_weight_format(loaded.model, config.quantization, config.quantization_skip, pack=config.pack_weights,
                                activation_dtype=config.activation_dtype)
        _report_block_rounding(loaded.model, config.quantization)
        _report_block_embedding(loaded.model)
    if config.activation_dtype != "int16" and not any(isinstance(m, BlockLinear) for m in loaded.model.modules()):
        logger.warning("activation_dtype=%r has no effect: no projection is in a block format (quantization=%r); "
                       "only asyncinfer's block-format kernels round activations (docs/formats.md)",
                       config.activation_dtype, config.quantization)
    weights = weight_bytes(mc, config.dtype_bytes, config.quantization, config.quantization_skip, config.device)
    spec = KVCacheSpec.from_model_config(mc, block_size=config.block_size, dtype=config.dtype, device=config.device)
    plan = plan_for_engine(config, mc, spec, weight_bytes=weights, free_bytes=available_memory(config.device))
    logger.info("memory plan: %s", plan.describe())
    decode = select_decode_backend(loaded.model, mc, config.device)  # the one choice of how the model runs
    if (config.quantization in BLOCK_FORMATS or config.quantization == NATIVE) and not isinstance(decode, KernelDecode):
        logger.info("quantization=%r: decode steps run op by op, not in one kernel call: %s", config.quantization,
                    kernel_decode_blocker(loaded.model, tuple(config.quantization_skip or ())))
    runner = ModelRunner(loaded.model, mc, spec, num_blocks=plan.num_blocks, decode=decode,
                         compile_seconds=compile_seconds)
    kv = KVCacheManager(
        plan.num_blocks, spec.block_size, watermark=config.kv_watermark,
        enable_prefix_caching=config.enable_prefix_caching, prefix_group=_prefix_group(runner),
        sliding_window=mc.kv_window,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        decode_padding=decode.attention.decode_padding,
    )
    eos = default_eos_ids(mc.eos_token_ids, loaded.tokenizer)
    core = EngineCore(
        runner=runner,
        scheduler=_create_scheduler(config, scheduler_config, kv),
        sampler=Sampler(mc.vocab_size, config.device, eos_token_ids=eos, seed=config.seed),
        tokenizer=loaded.tokenizer,
        eos_token_ids=eos,
        max_model_len=max_model_len,
        grammars=None if loaded.tokenizer is None else GrammarCompiler(loaded.tokenizer, mc.vocab_size, eos),
    )
    return plan, core


def _create_scheduler(config: EngineConfig, scheduler_config: SchedulerConfig, kv: KVCacheManager) -> Scheduler:
    """The engine's scheduler; a plugin's constructor that refuses its options with its own error (a plain
    ``ValueError``, not the contract's :class:`InvalidParameterError`) is the options' fault, named with the
    class and its file, not the model file's (``loading 'model.gguf' failed: weight must be positive``)."""
    try:
        return create_scheduler(config.scheduler, scheduler_config, kv, config.scheduler_options)
    except (AsyncInferError, *ENDS_ENGINE):
        raise
    except BaseException as exc:  # a plugin's own BaseException subclass (or CancelledError) is its fault too
        cls = resolve_scheduler(config.scheduler)
        source = _source_file(cls)
        where = f"{cls.__module__}.{cls.__qualname__}" + (f" in {source}" if source else "")
        raise InvalidParameterError(
            "scheduler_options", dict(config.scheduler_options or {}),
            f"options {cls.__name__} ({where}) accepts: its constructor raised {exception_text(exc)}") from exc


def _prefix_group(runner: ModelRunner) -> Callable[[Request], Hashable] | None:
    """The prefix cache's request groups (:class:`KVCacheManager`): none, except for a model whose K at a position
    depend on the request (a longrope model's requests longer than the original context read other rope rows
    below it; a request's group is taken when it gets its blocks, and one that grows past the original context is
    computed again, in new blocks: ``EngineCore``)."""
    rows = runner.rope_rows
    if not rows.original:
        return None

    def long(request: Request) -> bool:
        return rows.long(request.num_tokens)

    return long


def _kernel_formats(fmt: str) -> bool:
    """Whether a kernel takes ``fmt``, a block format or parts of them joined by "+"."""
    return all(part in BLOCK_FORMATS for part in fmt.split("+"))


def _preview_names(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def _report_block_embedding(model: Any) -> None:
    """Say where a token embedding kept in its file's blocks is held, and what the float32 table would have taken."""
    for name, layer in model.named_modules():
        if isinstance(layer, BlockEmbedding):
            table = layer.num_embeddings * layer.embedding_dim * 4
            held = "the tied head's blocks, no copy" if layer.shared else f"{layer.nbytes / MiB:.1f} MiB"
            logger.info("%s stays in its file's %s blocks (%s) instead of a %.1f MiB float32 table", name, layer.fmt,
                        held, table / MiB)


def _report_block_rounding(model: Any, method: str | None) -> None:
    """Say whether a block format holds the model's own weights (a GGUF file in those blocks) or
    rounded them (e.g. q4_1 on a float checkpoint: 4-bit weights, measure the quality); for "native",
    which projections kept their file's blocks (which of them mix formats part by part) and which went to the
    fallback format, and why."""
    if method == NATIVE:
        kept: dict[str, int] = {}
        mixed: dict[str, list[str]] = {}  # "q4_k+q4_k+q6_k" -> the layers whose parts are in those formats
        modules = list(model.named_modules())
        parts = {id(part) for _, layer in modules if isinstance(layer, MixedBlockLinear) for part in layer.parts}
        for name, layer in modules:
            if isinstance(layer, MixedBlockLinear):
                fmt = "+".join(part.fmt for part in layer.parts)
                kept[fmt] = kept.get(fmt, 0) + 1
                mixed.setdefault(fmt, []).append(name)
            elif isinstance(layer, BlockLinear) and id(layer) not in parts:  # a mixed layer's part counts there
                kept[layer.fmt] = kept.get(layer.fmt, 0) + 1
        stored = dict(model.config.stored_formats)
        fallback = {name: fmt for name, fmt in layer_formats(model.config, NATIVE).items()
                    if fmt not in BLOCK_FORMATS and not mixed_parts(fmt)}
        reasons: dict[str, int] = {}
        for name in fallback:
            reason = stored.get(name, "?")
            if mixed_parts(reason):  # the parts' formats, not their row counts
                reason = "+".join(part for part, _ in mixed_parts(reason))
            reasons[reason] = reasons.get(reason, 0) + 1
        logger.info("quantization='native': %d projections in their file's own blocks (%s); %d in %s (%s)",
                    sum(kept.values()), ", ".join(f"{fmt}: {n}" for fmt, n in sorted(kept.items())) or "none",
                    len(fallback), native_fallback(),
                    ", ".join(f"{n} stored as {fmt}, which no kernel takes" if not _kernel_formats(fmt)
                              else f"{n} stored as {fmt}, skipped or not whole blocks"
                              for fmt, n in sorted(reasons.items())) or "none")
        for fmt, names in sorted(mixed.items()):
            logger.info("quantization='native': %d projection(s) mix formats part by part (%s): %s", len(names),
                        fmt, _preview_names(names))
        return
    if method not in BLOCK_FORMATS:
        return
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    rounded = sum(not layer.lossless for layer in layers)
    if rounded:
        logger.warning("quantization=%r rounded the weights of %d of %d projections to its blocks (they were not "
                       "stored in them): expect some loss of quality; benchmarks/quality.py --model measures it",
                       method, rounded, len(layers))
    else:
        logger.info("quantization=%r: all %d projections hold the checkpoint's own weights", method, len(layers))


# How long a warm-up waits on a scheduler that schedules nothing when ``stall_timeout`` is None (a load never hangs).
WARM_UP_STALL_LIMIT = 30.0


def warm_up(core: EngineCore, stall_timeout: float | None = None) -> None:
    """Run one tiny greedy request through a fresh core, then clear what it left behind.

    The request asks two tokens, so the scheduler plans a prefill and then a decode: with one token it ended at its
    first step, and a plugin whose plan broke the contract (or whose hook raised) only for a request in decode passed
    the warm-up, its load succeeding with a scheduler that failed every request of more than one token.

    A scheduler that schedules nothing for ``stall_timeout`` seconds (``WARM_UP_STALL_LIMIT`` when None)
    while the request waits fails the warm-up with a ``RuntimeError`` naming it, as the engine thread
    would fail the request with ``RequestStalledError``: the load then raises, it never hangs.
    """
    limit = WARM_UP_STALL_LIMIT if stall_timeout is None else stall_timeout
    # with the sampled tokens' log-probabilities: a model whose logits are not finite is refused (_check_warm_up_outputs)
    request = Request("warm-up", [0], SamplingParams(max_tokens=2, ignore_eos=True, logprobs=0),
                      arrival_time=time.time())
    _check_warm_up_outputs(core, core.add_request(request))
    stalled_since: float | None = None
    wait = 0.0
    while core.has_unfinished_requests():
        ran = core.stats.steps
        try:
            outputs = core.step()
        except ENDS_ENGINE:
            raise
        except BaseException as exc:  # a plugin's BaseException subclass (or CancelledError) escaped the load bare
            source = _raised_in(exc, type(core.scheduler))
            if source is None:
                raise
            raise RuntimeError(
                f"the scheduler {type(core.scheduler).__name__} raised {exception_text(exc)} during warm-up, in its "
                f"own code ({source}): the load is refused (docs/schedulers.md, \"When it goes wrong\")") from exc
        _check_warm_up_outputs(core, outputs)
        if core.stats.steps > ran:
            stalled_since, wait = None, 0.0
            continue
        now = time.monotonic()
        stalled_since = now if stalled_since is None else stalled_since
        if now - stalled_since >= limit:
            raise RuntimeError(
                f"the scheduler {type(core.scheduler).__name__} scheduled nothing during warm-up for "
                f"{now - stalled_since:.1f} s (stall_timeout={stall_timeout}) while its one request waited "
                f"with every KV block free: schedule() must schedule a runnable request (docs/schedulers.md)")
        wait = idle_backoff(wait)  # as the engine thread does, instead of spinning
        time.sleep(wait)
    core.reset_prefix_cache()
    core.stats = StepStats()
    core.kv.num_prefix_queries = core.kv.num_prefix_hits = 0


def _check_warm_up_outputs(core: EngineCore, outputs: list[CoreOutput]) -> None:
    """Refuse the load when the warm-up request failed: a hook of the scheduler that raised (``add_request``,
    ``finish_requests``, ...) or a plan that broke the contract fails that request alone, not the step, so the
    warm-up ran to its end and the load succeeded with a scheduler that failed every request sent to it. And when
    a token's log-probability is not finite: NaN or infinite logits, from weights that hold such values (a tensor's
    bytes corrupted: every request then generated token 0 to its length, without a word)."""
    for output in outputs:
        for logprob in output.logprobs or ():
            if not math.isfinite(logprob.logprob):
                raise RuntimeError(
                    f"the model's logits are not finite at warm-up (the log-probability of its first tokens is "
                    f"{logprob.logprob}): its weights hold NaN or infinite values (a corrupt file?); the load is "
                    "refused")
        if output.error is None:
            continue
        cause = output.error.__cause__ if output.error.__cause__ is not None else output.error
        source = _raised_in(cause, type(core.scheduler))
        where = f", in its own code ({source})" if source is not None else ""
        raise RuntimeError(
            f"the scheduler {type(core.scheduler).__name__} failed the warm-up request{where}: {output.error} "
            f"(the load is refused; docs/schedulers.md, \"When it goes wrong\")") from output.error


def _raised_in(exc: BaseException, cls: type) -> str | None:
    """``cls``'s own source file where ``exc`` was raised with a frame of it on its stack (a scheduler plugin's
    ``schedule()`` or a hook, not the model or the engine), else None: the warm-up then names the plugin, whose
    error read as the model file's (``loading 'model.gguf' failed: 'oops'``)."""
    source = _source_file(cls)
    if source is None:
        return None
    target = os.path.realpath(source)
    on_stack = any(os.path.realpath(frame.filename) == target for frame in traceback.extract_tb(exc.__traceback__))
    return source if on_stack else None


def _source_file(cls: type) -> str | None:
    """The file a scheduler class was defined in, None for one without a file (built in the REPL)."""
    try:
        return inspect.getsourcefile(cls)
    except TypeError:
        return None


# ------------------------------------------------------------- before loading
def plan_model_memory(
    model: ModelRef | ModelConfig, *, available_bytes: int | None = None, **options: Any
) -> MemoryPlan | EmbeddingPlan:
    """The memory plan :func:`load` would make, from the model's config alone (no weights read).

    Raises:
        InvalidParameterError: an unknown option or an out-of-range value.
        ModelLoadError: the model's config cannot be read.
        ConfigurationError: the KV cache cannot hold one ``max_model_len`` request, or an
            embedding model does not fit in the memory.
    """
    available_bytes = check_available_bytes(available_bytes)
    if isinstance(model, ModelConfig):  # a generator's config, given directly
        return plan_memory(model, available_bytes=available_bytes, **options)
    path = resolve_model(model)
    if is_encoder_dir(path):
        config = EmbeddingConfig.from_options(options)
        plan = plan_embedding(read_encoder_config(path), config)
        shortfall = embedder_shortfall(plan, config, available_bytes, beside=False)  # nothing is loaded yet
        if shortfall is not None:
            raise ConfigurationError(shortfall)
        return plan
    config = EngineConfig.from_options(options)
    check_scheduler_options(config.scheduler, config.scheduler_options)  # as load() does, before any weight
    plan = plan_memory(path, available_bytes=available_bytes, **options)
    check_builtin_scheduler(config, plan)
    return plan


def check_builtin_scheduler(config: EngineConfig, plan: MemoryPlan) -> None:
    """Build a built-in scheduler once with the plan's figures, before any weight is read, so that an option value
    it refuses (pd-split's ``prefill_budget="x"``) is refused with the plan (``asyncinfer serve`` prints it before
    loading), not after the load. A plugin's constructor runs at the load only: it may do more than check.

    Raises:
        InvalidParameterError: the scheduler's constructor refused an option.
    """
    if not isinstance(config.scheduler, str) or config.scheduler not in builtin_schedulers():
        return
    kv = KVCacheManager(max(1, min(plan.num_blocks, 1024)), plan.block_size)  # its size is no option's concern
    scheduler_config = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=plan.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
    )
    create_scheduler(config.scheduler, scheduler_config, kv, config.scheduler_options)


#: Memory enough for any plan: what :func:`generator_shortfall` plans with to tell options a model cannot run
#: with from a lack of memory.
UNBOUNDED_MEMORY = 1 << 60


@dataclass(frozen=True)
class Shortfall:
    """Why a generator cannot be placed: ``reason``, with the fix; ``any_memory``: its options cannot run
    whatever memory is free (a KV cache smaller than one request), so freeing memory would not help."""

    reason: str
    any_memory: bool = False

    def __str__(self) -> str:
        return self.reason


def generator_shortfall(
    model: ModelRef,
    options: dict[str, Any],
    available: int | None,
    beside: str,
    error: type[ModelLoadError] = SwapError,
    freed: int = 0,
) -> Shortfall | None:
    """Why the generator cannot be placed beside ``beside``, with the fix, or None when it fits.

    Reads only the model's config, so a missing or unreadable model fails
    here (as ``error``), before anything is drained or loaded. ``freed``: bytes
    that will be given back before the load (a drain-mode swap's serving version).
    """
    config = EngineConfig.from_options(options)
    try:
        path = resolve_model(model)
        if is_encoder_dir(path):  # its config reads as an unsupported model_type, as if the file were broken
            raise ModelLoadError("it is a sentence encoder (an embedding model), not a generator: serve it beside the "
                                 "generators with add_model(name, model) (swap_model replaces a generator with a "
                                 "generator)")
        avail = (available_memory(config.device) if available is None else available) + freed
        plan = plan_memory(path, available_bytes=avail, **options)
    except ConfigurationError as exc:
        reason = str(exc).removeprefix("the model does not fit: ")
        try:  # an option the model cannot run with (a KV cache too small for one request) is no lack of memory
            plan_memory(path, available_bytes=UNBOUNDED_MEMORY, **options)
        except ConfigurationError as unbounded:
            if str(unbounded) == str(exc):
                return Shortfall(f"the new model cannot run with these options, whatever memory is free: {reason}",
                                 any_memory=True)
        return Shortfall(f"the new model does not fit beside {beside}: {reason}")
    except ModelLoadError as exc:
        raise error(f"cannot load {model_text(model)!r}: {exc}; the serving models are untouched") from exc
    need = plan.weight_bytes + plan.kv_bytes + plan.activation_reserve
    if need > avail:
        return Shortfall(
            f"the new model does not fit beside {beside}: weights {plan.weight_bytes / MiB:.1f} MiB"
            f" + KV cache {plan.kv_bytes / MiB:.1f} MiB + activation reserve {plan.activation_reserve / MiB:.1f} MiB"
            f" = {need / MiB:.1f} MiB, but {avail / MiB:.1f} MiB are available now;"
            " lower kv_cache_memory / kv_cache_fraction / max_model_len"
        )
    return None


def embedder_shortfall(
    plan: EmbeddingPlan, config: EmbeddingConfig, available: int | None, *, beside: bool = True
) -> str | None:
    """Why the embedding model cannot be placed (``beside`` the loaded models, for ``add_model``; alone, for a plan
    made before loading), with what to lower, or None when it fits."""
    avail = available_memory(config.device) if available is None else available
    if plan.total_bytes <= avail:
        return None
    where = " beside the loaded models" if beside else ""
    head = (f"the embedding model does not fit{where}: {plan.describe()} = {plan.total_bytes / MiB:.1f} MiB, but "
            f"{avail / MiB:.1f} MiB are available now")
    if plan.weight_bytes >= avail:
        return f"{head}; its weights alone need {plan.weight_bytes / MiB:.1f} MiB: try a smaller model or dtype."
    # the limits that make the largest batch: lowering another changes nothing (add_model said "Lower
    # max_batch_size / max_seq_len." where the default 32 texts never bind, 2048 slots holding 8 texts of 256 tokens)
    texts, tokens = plan.largest_batch or (plan.max_batch_size, plan.max_seq_len)
    limits = []
    if texts > 1:
        limits.append("max_batch_size" if texts == config.max_batch_size else "max_batch_tokens")
    if tokens == plan.max_seq_len or not limits:
        limits.append("max_seq_len")
    return f"{head}; lower {' / '.join(limits)}."


def embedder_shortfall_at(path: Path, config: EmbeddingConfig, available: int | None) -> str | None:
    """:func:`embedder_shortfall` beside the loaded models for the encoder at ``path`` (reads only its config)."""
    return embedder_shortfall(plan_embedding(read_encoder_config(path), config), config, available)
