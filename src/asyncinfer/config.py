"""Engine options: one frozen dataclass, validated on construction.

Every keyword of ``AsyncEngine.from_pretrained`` lands here; an unknown keyword
or an out-of-range value raises :class:`InvalidParameterError` naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from asyncinfer.errors import InvalidParameterError
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.quant import (
    ACTIVATION_DTYPES,
    check_quantization,
    format_dtype,
    resolve_pack,
    resolve_quantization,
    resolve_skip,
    spelled_quantization,
)
from asyncinfer.plain import plain_value

_T = TypeVar("_T")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f16": torch.float16,
}


def spelled_dtype(dtype: object) -> object:
    """A dtype's name as the engine reads it: any case, spaces around and ``torch.`` ("FP32", "BF16",
    "torch.Float16") in lower case; anything else as given (``resolve_dtype`` refuses it)."""
    if not isinstance(dtype, str):
        return dtype
    spelled = dtype.strip().lower()
    return spelled if spelled == "auto" or spelled.removeprefix("torch.") in _DTYPES else dtype


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    allowed = "'cpu', 'cuda', 'cuda:N' or 'auto'"
    if isinstance(device, str) and device.strip().lower().split(":")[0] in ("gpu", "mps", "xpu", "hip", "rocm",
                                                                           "metal", "vulkan", "opencl"):
        allowed += " (a GPU is 'cuda', an NVIDIA GPU: asyncinfer runs on no other kind)"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:  # ValueError: an index past a C long (10**400)
        raise InvalidParameterError("device", device, allowed) from exc
    if dev.type not in ("cpu", "cuda"):
        raise InvalidParameterError("device", device, allowed)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", device, "'cpu' (no CUDA device is available here)")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/"auto": float32 on CPUs (bf16 matmuls crawl without AVX-512/AMX), bf16 on CUDA; a name in any
    case (:func:`spelled_dtype`)."""
    dtype = spelled_dtype(dtype)  # type: ignore[assignment]
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise InvalidParameterError("dtype", dtype, "'auto', 'float32', 'float16', 'bfloat16' or the torch dtype")


#: The half dtypes already warned about in this process (:func:`warn_slow_cpu_dtype`): each once.
_WARNED_SLOW_DTYPES: set[torch.dtype] = set()


def cpu_has_fast_matmul(dtype: torch.dtype) -> bool | None:
    """Whether this CPU multiplies ``dtype`` (float16, bfloat16) matrices natively (oneDNN's check: AVX-512
    BF16/AMX for bfloat16, AVX-512 FP16/AMX-FP16 for float16); None where torch cannot say."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return None
    return True


#: What :func:`warn_slow_cpu_dtype` offers instead, for a generator: its weight formats keep the weights small.
FASTER_FOR_A_GENERATOR = ("dtype='auto' (--dtype auto: float32 activations, the weights kept small by "
                          "quantization='auto', float16 or the GGUF file's own blocks) is faster")
#: ... and for a sentence encoder, which has no weight format: float32.
FASTER_FOR_AN_ENCODER = "dtype='auto' (--dtype auto: float32 on a CPU) is faster"


def warn_slow_cpu_dtype(dtype: torch.dtype, device: torch.device, faster: str = FASTER_FOR_A_GENERATOR) -> None:
    """Warn (``logging.warning`` on "asyncinfer", once per dtype and process) when ``dtype`` is float16 or
    bfloat16 on a CPU without native matrix kernels for it: every matmul is then emulated,
    slower than float32 activations (measured: 1.4x per matmul on an AVX-512 CPU without FP16), and the weights
    can be made as small with a weight format instead. ``faster`` says what to use instead, for the kind of model
    (an encoder has no weight format)."""
    if device.type != "cpu" or dtype not in (torch.float16, torch.bfloat16) or dtype in _WARNED_SLOW_DTYPES:
        return
    if cpu_has_fast_matmul(dtype) is not False:
        return
    _WARNED_SLOW_DTYPES.add(dtype)
    name = str(dtype).removeprefix("torch.")
    logging.getLogger("asyncinfer").warning(
        "dtype=%s is slow on this CPU (it has no native %s matrix kernels, so each one is emulated): %s "
        "(docs/formats.md)", name, name, faster)


#: Whether :func:`warn_slow_bf16_activations` has warned in this process.
_WARNED_SLOW_BF16_ACTIVATIONS: list[bool] = []


def warn_slow_bf16_activations(activation_dtype: str, device: torch.device) -> None:
    """Warn (``logging.warning`` on "asyncinfer", once per process) when ``activation_dtype`` is "bfloat16" on a CPU
    without native bfloat16 matrix kernels (as :func:`warn_slow_cpu_dtype` decides): the block formats' bigger
    steps then multiply in emulated bfloat16, slower than the default int16's."""
    if (activation_dtype != "bfloat16" or device.type != "cpu" or _WARNED_SLOW_BF16_ACTIVATIONS
            or cpu_has_fast_matmul(torch.bfloat16) is not False):
        return
    _WARNED_SLOW_BF16_ACTIVATIONS.append(True)
    logging.getLogger("asyncinfer").warning(
        "activation_dtype='bfloat16' is slow on this CPU (it has no native bfloat16 matrix kernels, so each product "
        "is emulated): activation_dtype='int8' (or the default 'int16') is faster (docs/formats.md)")


def plain_fields(options: Any) -> None:
    """Make each ``int``, ``float`` and ``str`` field of the frozen options dataclass ``options`` the plain
    value it holds (of a subclass too; never a ``bool``), before its checks run: an ``int`` subclass whose
    comparisons answer as another number passed every range check with what it held (a ``block_size`` of 0
    that compared as 4 failed the load with a ``ZeroDivisionError``; a ``max_num_seqs`` of -3 served), and the
    options keep no object whose methods are the caller's."""
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        plain = plain_value(value)
        if plain is not value:
            object.__setattr__(options, f.name, plain)


#: The most torch intra-op threads ``num_threads`` may ask for: OpenMP aborts the whole process (no exception to
#: catch) when told to start a team far beyond any machine's cores (``num_threads=20000``).
MAX_THREADS = 4096

#: The most bytes a byte-count option (``kv_cache_memory``, ``activation_reserve``, ``available_bytes``) may hold: a
#: torch size's range (int64). A larger int failed the plan with ``OverflowError`` (its float division overflowed), not
#: an error naming it.
MAX_BYTES = 2**63 - 1

#: The most requests one step may hold (``max_num_seqs``).
MAX_NUM_SEQS = 4096


#: The most tokens a KV block holds (``block_size``).
MAX_BLOCK_SIZE = 256


def check_int(name: str, value: Any, low: int, high: int | None = None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameterError(name, value, allowed)
    if value < low or (high is not None and value > high):
        raise InvalidParameterError(name, value, allowed)


@dataclass(frozen=True)
class EngineConfig:
    """Engine options (all keyword arguments of ``AsyncEngine.from_pretrained``).

    - ``dtype``: weights, activations and KV cache dtype; "auto" = float32 on CPU, bf16 on CUDA.
    - ``device``: "cpu", "cuda", "cuda:N" or "auto".
    - ``block_size``: tokens per KV block (1..256).
    - ``kv_cache_memory``: KV budget in bytes; overrides ``kv_cache_fraction``.
    - ``kv_cache_fraction``: KV budget as a fraction of free memory after the weights
      (available RAM on CPU, free device memory on CUDA), in (0, 0.95]. None (default):
      on CPU, room for ``min(max_num_seqs, 4)`` requests of ``max_model_len`` tokens (each in whole blocks), at
      most 25 % of the free memory; on CUDA, 25 % of the free memory (see ``memory.py``).
    - ``max_num_seqs``: requests in one step (1..4096).
    - ``max_num_batched_tokens``: tokens in one step (>= 1; chunked prefill splits longer prompts).
    - ``max_model_len``: prompt + output tokens per request; default: the model's context length.
    - ``enable_chunked_prefill``: split long prompts over steps (default on).
    - ``scheduler``: "fifo" (default), "length-bucket", "aging-priority", "pd-split", another
      registered or entry-point name, a Scheduler subclass or "module:Class".
    - ``scheduler_options``: keyword arguments for the scheduler's constructor (a dict, or None).
    - ``seed``: seed of the engine-wide generator used by sampling requests that set no
      ``SamplingParams.seed``. None (default): fresh entropy from the OS for each engine (and each
      model version), so unseeded samples differ from one engine, or one run, to the next; an int
      in [0, 2**63 - 1] makes them repeat for the same traffic in the same order. A request's own
      seed is reproducible either way.
    - ``num_threads``: torch intra-op threads for the CPU, 1..``MAX_THREADS`` (4096; default: leave torch's setting).
    - ``activation_reserve``: bytes kept free for activations when sizing the KV cache by fraction.
    - ``quantization``: the weight format of every projection and the LM head (docs/formats.md).
      "auto" (default): on a CPU with ``dtype`` "auto", the model's own block format, "q4_1" or
      "q8_0" (a GGUF file that stores every projection in it, as the default model's does in
      "q4_1"), or "native" for a file of several formats, where asyncinfer's kernels run a
      vectorised variant (or ``ASYNCINFER_KERNEL_ISA`` asks for one), else "float16" where fbgemm runs (the fastest format whose greedy output
      equals float32's), else None; elsewhere (CUDA, or another ``dtype``) None. The rule is
      ``models.quant.resolve_quantization``; after construction ``config.quantization`` holds the
      value for a model without a format of its own, and the load makes it concrete for the
      model's file (``for_model``). None: the engine dtype (pass ``dtype="float32"`` or
      ``quantization=None`` for float32 weights on a CPU). On CPU, with float32 activations:
      "q4_1" or "q8_0" (ggml's blocks on asyncinfer's kernels), ggml's other block formats "q4_0",
      "q5_0", "q5_1", "q4_k", "q5_k", "q6_k" (the same kernels), "native" (each projection in its GGUF
      file's own format where a kernel takes it, float16 elsewhere), "float16" (fp16 weights,
      fbgemm's fp16 kernel; half the bytes, near-exact) or "int8" (int8 weights, activations
      quantized per call to 8 bits; a quarter of the bytes, not exact). On CUDA "float16" or
      "bfloat16" name the engine dtype (``dtype="auto"`` takes it; another dtype is refused).
      Other combinations raise InvalidParameterError naming ``quantization``.
    - ``quantization_skip``: substrings of layer names kept in float32 under a CPU format;
      None (default): the format's own list (int8: ("down_proj", "lm_head"), from the per-layer
      sensitivity in benchmarks/quality.py; float16: none).
    - ``pack_weights``: pack the float32 projection weights (all of them, or those a format
      skips) into oneDNN's blocked layout at load: the same values, a faster CPU kernel. None
      (default): wherever possible (CPU, float32, torch built with oneDNN; never on CUDA);
      False: plain ``F.linear``; True: required (refused where it cannot run).
    - ``activation_dtype``: how the block formats' kernels round a step's activations, per run of 32
      values: "int16" (default: in steps of fewer than 9 tokens, a single user's decode or a few
      users'; within float32's rounding of the exact product; greedy output equals float32's on the
      default model; larger steps multiply in float32) or "int8" (in every step, prefills and batched
      decodes too: llama.cpp's numerics, the weights' bytes multiplied as they come, faster, about 1%
      of a product's size off, a request's logits independent of its batch but for its last bits where
      its decode steps cross kernels.STEP_TILE_MIN_ROWS rows in a format not held in lanes; the AVX-512
      builds round the k-quants' activations per 256 in both kernels, as llama.cpp does); docs/formats.md,
      "Activations", has its speed and its quality gate) or "bfloat16" (int16's in steps of fewer than 9
      tokens; bigger steps, prefills, multiply the weights rebuilt as bfloat16 by the activations rounded to
      bfloat16, in torch: on CPUs with AMX about 2x the int8 tile's speed from 128 tokens, slower than it below
      about 32; emulated and slow on CPUs without AMX or AVX-512 BF16, where a warning says so; docs/formats.md,
      "Batched steps"). Read in any case. No effect on
      other weight formats.
    - ``torch_compile``: compile the decoder's element-wise chains (RMSNorm, the rotary
      embedding, SwiGLU's ``silu(gate) * up``) with ``torch.compile`` at load (default off:
      measured slower for SmolLM2-135M on a 2-core CPU and on an H200; docs/formats.md). Needs
      a C++ compiler on a CPU and Triton on CUDA, else the load raises ConfigurationError;
      the compile time is ``ModelVersionInfo.compile_seconds``.
    - ``enable_prefix_caching``: reuse the KV blocks of prompt prefixes seen before (default on).
    - ``max_waiting_requests``: admission control: how many requests may wait beyond the
      ``max_num_seqs`` a generator runs at once; past that, new requests fail at once with
      :class:`~asyncinfer.errors.EngineOverloadedError` (an HTTP layer's 503 + Retry-After).
      None (default): no bound.
    - ``kv_watermark``: fraction of the KV blocks kept free from new admissions so that
      running requests can keep decoding, in [0, 0.5] (default 0.01).
    - ``max_consecutive_step_failures``: fault isolation. A step that raises (forward pass,
      sampler, scheduler) fails only its own requests with
      :class:`~asyncinfer.errors.RequestFailedError` and the engine serves the next ones;
      this many failed steps of one model in a row (no step succeeding between them)
      declare the engine dead, and every waiter gets ``EngineDeadError`` (default 3, >= 1).
    - ``stall_timeout``: liveness. While every request is stuck (the scheduler schedules
      nothing) the engine thread backs off instead of spinning; after this many seconds
      of it the stuck requests fail with :class:`~asyncinfer.errors.RequestStalledError`
      (default 30.0; a finite number > 0, or None to let them wait forever).
    - ``enable_metrics``: record ``engine.metrics`` (default on; off, the engine installs no step hook).
    - ``memory_bandwidth``: the device's memory bandwidth in bytes per second, the roofline
      gauge's denominator; None (default): measured once at start-up with a short copy.
    - ``log_request_text_rate``: the fraction of requests whose prompt and output text the
      ``asyncinfer.requests`` INFO line includes, for debugging, in [0, 1] (default 0: never).
    """

    dtype: Any = "auto"
    device: Any = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_fraction: float | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    scheduler: Any = "fifo"
    scheduler_options: dict[str, Any] | None = None
    seed: int | None = None
    num_threads: int | None = None
    activation_reserve: int = 256 * 1024 * 1024
    quantization: str | None = "auto"
    quantization_skip: tuple[str, ...] | None = None
    pack_weights: bool | None = None
    activation_dtype: str = "int16"
    torch_compile: bool = False
    enable_prefix_caching: bool = True
    kv_watermark: float = 0.01
    max_waiting_requests: int | None = None
    max_consecutive_step_failures: int = 3
    stall_timeout: float | None = 30.0
    enable_metrics: bool = True
    memory_bandwidth: float | None = None
    log_request_text_rate: float = 0.0

    def __post_init__(self) -> None:
        plain_fields(self)
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", spelled_dtype(self.dtype))  # "AUTO" is "auto" to the format's choice too
        object.__setattr__(self, "quantization", resolve_quantization(self.quantization, device, self.dtype))
        object.__setattr__(self, "dtype", resolve_dtype(format_dtype(self.quantization, device, self.dtype), device))
        check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        check_int("kv_cache_memory", self.kv_cache_memory, 1, MAX_BYTES, optional=True)
        frac = self.kv_cache_fraction
        bad_frac = isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac <= 0.95
        if frac is not None and bad_frac:
            raise InvalidParameterError("kv_cache_fraction", frac, "a number in (0, 0.95], or None (from the workload)")
        check_int("max_num_seqs", self.max_num_seqs, 1, MAX_NUM_SEQS)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_model_len", self.max_model_len, 2, optional=True)
        check_int("seed", self.seed, 0, 2**63 - 1, optional=True)
        check_int("num_threads", self.num_threads, 1, MAX_THREADS, optional=True)
        check_int("activation_reserve", self.activation_reserve, 0, MAX_BYTES)
        check_int("max_waiting_requests", self.max_waiting_requests, 0, optional=True)
        check_int("max_consecutive_step_failures", self.max_consecutive_step_failures, 1)
        st = self.stall_timeout
        if st is not None and (isinstance(st, bool) or not isinstance(st, (int, float)) or not 0 < st < math.inf):
            raise InvalidParameterError("stall_timeout", st, "a finite number of seconds > 0, or None")
        _check_weight_format(self)
        warn_slow_cpu_dtype(self.dtype, device)
        if isinstance(self.activation_dtype, str) and self.activation_dtype.strip().lower() in ACTIVATION_DTYPES:
            object.__setattr__(self, "activation_dtype", self.activation_dtype.strip().lower())  # any case, as formats
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise InvalidParameterError("activation_dtype", self.activation_dtype, f"one of {list(ACTIVATION_DTYPES)}")
        warn_slow_bf16_activations(self.activation_dtype, device)
        opts = self.scheduler_options
        if opts is not None and not (isinstance(opts, dict) and all(isinstance(k, str) for k in opts)):
            raise InvalidParameterError("scheduler_options", opts, "a dict of keyword arguments, or None")
        if not isinstance(self.enable_chunked_prefill, bool):
            raise InvalidParameterError("enable_chunked_prefill", self.enable_chunked_prefill, "True or False")
        if not isinstance(self.torch_compile, bool):
            raise InvalidParameterError("torch_compile", self.torch_compile, "True or False")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidParameterError("enable_prefix_caching", self.enable_prefix_caching, "True or False")
        _check_metrics_options(self)
        wm = self.kv_watermark
        if isinstance(wm, bool) or not isinstance(wm, (int, float)) or not 0.0 <= wm <= 0.5:
            raise InvalidParameterError("kv_watermark", wm, "a number in [0, 0.5]")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """Build from ``from_pretrained`` keywords, rejecting unknown ones by name."""
        return from_options(cls, options, "a known option")

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def for_model(config: EngineConfig, options: dict[str, Any], model_config: ModelConfig, *,
              warn: bool = True) -> EngineConfig:
    """``config`` with ``quantization="auto"`` made concrete for the model it will load: its GGUF file's
    own block format where that applies (:func:`~asyncinfer.models.quant.resolve_quantization`), the
    config as resolved without the model otherwise. Options that name a format are kept as given.
    ``warn``: log that the file's own format was passed over because the kernels cannot run (False for a
    second resolution of the same load or plan, which has logged it already)."""
    if spelled_quantization(options.get("quantization", "auto")) != "auto":
        return config
    native = model_config.native_format
    dtype = spelled_dtype(options.get("dtype", "auto"))
    fmt = resolve_quantization("auto", config.device, dtype, native)
    if warn and native is not None and fmt != native and config.device.type == "cpu" and dtype in (None, "auto"):
        from asyncinfer import kernels

        logging.getLogger("asyncinfer").warning(
            "the model's own %s blocks would be the default weight format, but asyncinfer's kernels %s here (%s): "
            "using %s instead (docs/formats.md)", native,
            "cannot run" if not kernels.available() else "run only as their scalar reference", kernels.auto_reason(),
            fmt)
    if fmt == config.quantization:
        return config
    return dataclasses.replace(config, quantization=fmt, quantization_skip=options.get("quantization_skip"),
                               pack_weights=options.get("pack_weights"), dtype=dtype)


def _check_weight_format(config: EngineConfig) -> None:
    """Validate ``quantization`` and resolve ``quantization_skip`` (None: the format's) and ``pack_weights``."""
    check_quantization(config.quantization, config.device, config.dtype)
    object.__setattr__(config, "quantization_skip", resolve_skip(config.quantization, config.quantization_skip))
    object.__setattr__(config, "pack_weights", resolve_pack(config.pack_weights, config.device, config.dtype))


def _check_metrics_options(config: EngineConfig) -> None:
    if not isinstance(config.enable_metrics, bool):
        raise InvalidParameterError("enable_metrics", config.enable_metrics, "True or False")
    bw = config.memory_bandwidth
    if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < float("inf")):
        raise InvalidParameterError("memory_bandwidth", bw, "bytes per second > 0, or None (measured at start-up)")
    rate = config.log_request_text_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise InvalidParameterError("log_request_text_rate", rate, "a fraction in [0, 1]")


class UnknownOptionError(InvalidParameterError):
    """A keyword that the options dataclass ``options`` (:class:`EngineConfig`, an embedding model's config) has no
    field for: an :class:`InvalidParameterError` naming it, which says which options were meant."""

    def __init__(self, parameter: str, value: object, allowed: str, options: type) -> None:
        super().__init__(parameter, value, allowed)
        self.options = options


def from_options(cls: type[_T], options: dict[str, Any], allowed: str) -> _T:
    """Build the options dataclass ``cls`` from keywords; an unknown one raises
    :class:`UnknownOptionError` naming it and listing ``allowed`` ones."""
    if not isinstance(options, Mapping):  # a list or None raised AttributeError: 'list' object has no attribute 'items'
        raise InvalidParameterError("options", options, "a dict of option names to their values (the keywords "
                                    "from_pretrained takes)")
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key, value in options.items():
        if key not in known:
            raise UnknownOptionError(key, value, f"{allowed}: {sorted(known)}{_other_tools_option(key, known)}", cls)
    return cls(**options)


#: Keywords of transformers, vLLM and llama-cpp-python, and what asyncinfer has for them.
_OTHER_OPTIONS: dict[str, str] = {
    "torch_dtype": "dtype", "n_ctx": "max_model_len", "max_seq_len": "max_model_len",
    "context_length": "max_model_len", "max_position_embeddings": "max_model_len", "n_threads": "num_threads",
    "threads": "num_threads", "gpu_memory_utilization": "kv_cache_fraction", "n_batch": "max_num_batched_tokens",
    "max_batch_size": "max_num_seqs", "n_gpu_layers": "device", "device_map": "device", "load_in_4bit": "quantization",
    "load_in_8bit": "quantization", "quantization_config": "quantization",
}
#: The commands' flags named otherwise than their option, as a keyword (``--engine-seed`` is ``seed``: the commands'
#: ``--seed`` is a request's).
_FLAG_OPTIONS: dict[str, str] = {"engine_seed": "seed"}
#: What a caller who passed the options as one object (``config=EngineConfig(...)``) is told.
_OPTIONS_ARE_KEYWORDS = ("the options are keywords themselves, of every call that takes them (from_pretrained, "
                         "load, plan_memory, swap_model, add_model): from_pretrained(model, {example}=..., ...), or "
                         "from_pretrained(model, **options) with a dict of them")
#: Keywords of other tools with nothing in asyncinfer to take them.
_NO_OPTION: dict[str, str] = {
    "tensor_parallel_size": "asyncinfer runs a model on one device (replicas on several: docs/scale_out.md)",
    "pipeline_parallel_size": "asyncinfer runs a model on one device (replicas on several: docs/scale_out.md)",
    "trust_remote_code": "asyncinfer runs no model code of its own (its own model classes only)",
    "config": _OPTIONS_ARE_KEYWORDS,
    "engine_config": _OPTIONS_ARE_KEYWORDS,
}


def _other_tools_option(key: str, known: set[str]) -> str:
    """The hint after an unknown option's list: the option asyncinfer has for another tool's keyword
    (``torch_dtype`` -> ``dtype``), why there is none, or a close spelling."""
    import difflib

    flag_option = _FLAG_OPTIONS.get(key)
    if flag_option in known:
        return f"; {key} is the commands' --{key.replace('_', '-')}: its option is {flag_option}"
    mapped = _OTHER_OPTIONS.get(key)
    if mapped in known:
        return f"; {key} is another library's name: asyncinfer's is {mapped}"
    if key in _NO_OPTION:  # a generator's options or an embedding model's: the example is one of them
        example = "max_model_len" if "max_model_len" in known else "max_seq_len" if "max_seq_len" in known else "dtype"
        return f"; {key} has no asyncinfer option: {_NO_OPTION[key].format(example=example)}"
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""
