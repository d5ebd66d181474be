"""``asyncinfer plan``: the memory budget of a deployment, from the model's config alone.

No weight is read. The two figures that must be exact come from the functions the
engine itself uses: the weights from ``models.quant.weight_bytes`` (int8-aware) and
the KV cache from the model's :class:`~asyncinfer.cache.spec.KVCacheSpec`
(``bytes_per_token``, ``block_bytes``: blocks of ``block_size`` tokens, as the engine
allocates them). Started with the ``kv_cache_memory`` and ``max_model_len`` the plan
prints, the engine allocates exactly the plan's blocks (``tests/test_planner.py``).

The other rows are estimates, labelled so: the activations of one step (the hidden
states and MLP of ``max_num_batched_tokens`` tokens, the logits of ``max_num_seqs``
rows, one layer's K/V gathered for the batched decode attention and, repeated to the query
heads, for a prefill chunk at the full length) and a fixed framework overhead (torch, Python, the
tokenizer and ``asyncinfer serve``'s HTTP server on a CPU, the CUDA context on a GPU).
``benchmarks/plan_check.py`` measures the peak of the engine and of the server against the total.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from asyncinfer.cache.kv_manager import blocks_for
from asyncinfer.cache.spec import KVCacheSpec
from asyncinfer.config import MAX_BYTES, MAX_NUM_SEQS, EngineConfig, resolve_dtype, spelled_dtype
from asyncinfer.errors import InvalidParameterError
from asyncinfer.memory import GiB, MiB
from asyncinfer.models.config import ModelConfig
from asyncinfer.models.layers import rope_table_bytes
from asyncinfer.models.quant import (
    check_quantization,
    default_skip,
    format_dtype,
    resolve_quantization,
    resolve_skip,
    smaller_cpu_formats,
    weight_bytes,
)

#: Framework overhead estimates: torch + Python + the tokenizer and what a load keeps beside the weights on a CPU,
#: with room for ``asyncinfer serve``'s HTTP stack (``benchmarks/plan_check.py`` measures the peak of both against
#: the plan's total: at 384 MiB the engine's peak was 1-3% over it, the server's 5-9%; at 480 the server's came
#: within 0.1% of it, its peak varying by up to 60 MiB from run to run), CUDA context + cuBLAS workspace on a GPU.
OVERHEAD_BYTES = {"cpu": 512 * MiB, "cuda": 768 * MiB}

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": MiB, "mib": MiB, "mb": 1000**2,
          "g": GiB, "gib": GiB, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"24GB"`` (10^9), ``"512MiB"``, ``"1.5T"`` (binary) or a plain byte count, at most
    ``MAX_BYTES`` (2**63 - 1), read exactly: a count is the integer written, not its nearest float (which
    turned 99999999999999999999999 into 99999999999999991611392, and a count of 400 digits into infinity)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text) if len(text) <= 64 else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidParameterError("device memory", text, "a size such as 24GiB, 80GB, 512MiB or a byte count")
    size = int(Fraction(match.group(1)) * _UNITS[unit])
    if size > MAX_BYTES:
        raise InvalidParameterError("device memory", text, f"a size of at most {MAX_BYTES} bytes (2**63 - 1)")
    return size


@dataclass(frozen=True)
class DeploymentPlan:
    """The budget of serving ``batch`` requests of ``seq_len`` tokens (prompt + output) in ``device_memory``."""

    model_name: str
    model_config: ModelConfig
    device: str  # "cpu" or "cuda"
    dtype: torch.dtype
    quantization: str | None
    batch: int
    seq_len: int
    block_size: int
    spec: KVCacheSpec
    weight_bytes: int
    kv_blocks: int
    activation_bytes: int
    overhead_bytes: int
    #: The rope tables at their peak (``models.layers.rope_table_bytes``): a row a position of the model's context,
    #: whatever ``seq_len`` (a header's context of 2**31 - 1 needs 280 GiB, which the plan called a fit).
    rope_bytes: int
    device_memory: int
    device_memory_source: str  # "given" or how it was measured
    max_num_batched_tokens: int
    max_num_seqs: int
    suggestions: tuple[str, ...] = field(default=())

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.spec.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.rope_bytes + self.kv_bytes + self.activation_bytes + self.overhead_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.device_memory - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    @property
    def max_batch(self) -> int:
        """The largest batch of ``seq_len``-token requests that fits."""
        return max_batch(self, self.seq_len)

    @property
    def max_seq_len(self) -> int:
        """The longest ``seq_len`` (up to the model's context) at which ``batch`` requests fit (0: none)."""
        low, high = 0, self.model_config.max_position_embeddings
        while low < high:  # the need grows with the length: bisect
            mid = (low + high + 1) // 2
            if max_batch(self, mid) >= self.batch:
                low = mid
            else:
                high = mid - 1
        return low

    def engine_options(self) -> dict[str, Any]:
        """Engine options under which the engine loads this plan's weights (its dtype and format) and
        allocates exactly its KV blocks (pass them with the plan's device)."""
        options: dict[str, Any] = {"kv_cache_memory": self.kv_bytes, "max_model_len": self.seq_len,
                                   "block_size": self.block_size, "dtype": _dtype(self.dtype),
                                   "quantization": self.quantization}
        defaults = EngineConfig.__dataclass_fields__  # the step the activations were planned for, where not the default
        for name, value in (("max_num_seqs", self.max_num_seqs), ("max_num_batched_tokens", self.max_num_batched_tokens)):
            if value != defaults[name].default:
                options[name] = value
        return options

    def flags(self) -> str:
        """:meth:`engine_options` and the device as the flags of ``asyncinfer serve`` (and ``chat``, ``generate``,
        ``bench``, ``info``), to paste after the command."""
        options = self.engine_options()
        return (f"--kv-cache-memory {options['kv_cache_memory']} --max-model-len {options['max_model_len']} "
                f"--block-size {options['block_size']} --dtype {options['dtype']} "
                f"--quantization {options['quantization'] or 'none'} --device {self.device}"
                + "".join(f" --{name.replace('_', '-')} {options[name]}"
                          for name in ("max_num_seqs", "max_num_batched_tokens") if name in options))

    def table(self) -> str:
        mc, spec = self.model_config, self.spec
        tokens = self.kv_blocks * self.block_size
        quant = f"{self.quantization} weights" if self.quantization else "no quantization"
        rows = [
            ("weights", self.weight_bytes, f"from the config's shapes in {_dtype(self.dtype)}"
             + (f", {self.quantization} projections" if self.quantization and self.device == "cpu" else "")),
            ("rope tables", self.rope_bytes,
             f"float32 cos and sin, a row for each of the model's {mc.max_position_embeddings} positions, at their peak"),
            ("KV cache", self.kv_bytes,
             (f"2 x {spec.num_layers} layers x {spec.num_kv_heads} kv heads x {spec.head_dim} head dim x "
              f"{spec.dtype_bytes} bytes x {tokens} tokens ({self.batch} x {self.seq_len}, in "
              f"{self.block_size}-token blocks)")),
            ("activations", self.activation_bytes,
             (f"estimate: a step of {self.max_num_batched_tokens} tokens, {self.max_num_seqs} rows of logits, "
              "one layer's K/V gathered for decode and for a prefill chunk's query heads")),
            ("framework overhead", self.overhead_bytes,
             "estimate: torch, Python, the tokenizer, the HTTP server" if self.device == "cpu" else "estimate: CUDA context and workspaces"),
            ("total", self.total_bytes, ""),
            ("headroom", self.headroom_bytes,
             f"{_size(self.device_memory)} {self.device} memory ({self.device_memory_source}) - total"),
        ]
        lines = [
            (f"{self.model_name}: {mc.architecture}, {mc.num_layers} layers, hidden {mc.hidden_size}, "
             f"{mc.num_heads} heads / {mc.num_kv_heads} kv heads, head dim {mc.head_dim}, context "
             f"{mc.max_position_embeddings}"),
            f"{self.device}, {_dtype(self.dtype)}, {quant}: {_count(self.batch, 'request')} x {_count(self.seq_len, 'token')}",
            "",
            f"  {'item':<20}{'size':>12}   how",
        ]
        lines += [f"  {name:<20}{_size(value):>12}   {how}".rstrip() for name, value, how in rows]
        lines += [
            "",
            f"largest batch at {self.seq_len} tokens: {self.max_batch}"
            + (f" (memory alone; one step runs at most max_num_seqs={self.max_num_seqs})"
               if self.max_batch > self.max_num_seqs else ""),
            f"longest length at batch {self.batch}: {self.max_seq_len}"
            + (" (the model's context)" if self.max_seq_len == mc.max_position_embeddings else ""),
            "engine options that load this plan (with device): "
            + " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in self.engine_options().items()),
            f"the same as flags: {self.flags()}",
        ]
        if self.batch > self.max_num_seqs:
            # a --max-num-seqs past the engine's own limit was offered, which the plan (and the engine) refuse
            most = min(self.batch, MAX_NUM_SEQS)
            advice = (f"plan with --max-num-seqs {most} to run {'all ' if most == self.batch else ''}{most} at once"
                      + ("" if most == self.batch else " (the engine's most)")
                      if most > self.max_num_seqs else f"{MAX_NUM_SEQS} is the engine's most")
            lines += ["", (f"note: at most max_num_seqs={self.max_num_seqs} requests run in one step, the other "
                           f"{self.batch - self.max_num_seqs} wait; {advice}")]
        if not self.fits:
            lines += ["", f"does not fit: {_size(-self.headroom_bytes)} short. Try:"]
            lines += [f"  - {s}" for s in self.suggestions]
        return "\n".join(lines)


def max_batch(plan: DeploymentPlan, seq_len: int) -> int:
    """Requests of ``seq_len`` tokens that fit beside the weights, the fixed activations and the overhead."""
    if seq_len < 1:
        return 0
    fixed = plan.weight_bytes + plan.rope_bytes + plan.overhead_bytes + _fixed_activations(plan) + _prefill_bytes(
        plan, seq_len)
    per_request = blocks_for(seq_len, plan.block_size) * plan.spec.block_bytes + _gather_bytes(plan.spec, seq_len)
    return max(0, (plan.device_memory - fixed) // per_request)


def _fixed_activations(plan: DeploymentPlan) -> int:
    """One step's activations that do not grow with the batch's lengths: hidden states, q/k/v and
    the MLP of ``max_num_batched_tokens`` tokens, and float32 logits (and probabilities) of ``max_num_seqs`` rows."""
    mc, nbytes = plan.model_config, plan.spec.dtype_bytes
    per_token = nbytes * (4 * mc.hidden_size + 3 * mc.intermediate_size + (mc.num_heads + 2 * mc.num_kv_heads)
                          * mc.head_dim)
    return plan.max_num_batched_tokens * per_token + 2 * 4 * plan.max_num_seqs * mc.vocab_size


def _prefill_bytes(plan: DeploymentPlan, seq_len: int) -> int:
    """A prefill chunk's attention at the end of a ``seq_len``-token prompt: one layer's K and V of the whole
    context, repeated to the query heads (the peak grew with the length by about this, beyond the rest)."""
    mc = plan.model_config
    return 2 * mc.num_heads * mc.head_dim * plan.spec.dtype_bytes * seq_len


def _gather_bytes(spec: KVCacheSpec, seq_len: int) -> int:
    """One request's K and V of one layer, gathered by the batched decode attention."""
    return spec.bytes_per_token // spec.num_layers * seq_len


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _count(n: int, noun: str) -> str:
    """``1 request``, ``16 requests``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(n: int) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    return f"{sign}{n / GiB:.2f} GiB" if n >= GiB else f"{sign}{n / MiB:.1f} MiB"


def plan_deployment(
    model_config: ModelConfig,
    *,
    model_name: str = "model",
    batch: int = 1,
    seq_len: int | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    quantization: str | None = "auto",
    quantization_skip: tuple[str, ...] | None = None,
    device_memory: int | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 128,
) -> DeploymentPlan:
    """The budget table's numbers (see the module docstring); ``device_memory`` None: measured here.

    Raises:
        InvalidParameterError: a bad count (``max_num_seqs`` and ``max_num_batched_tokens`` in the engine's
            ranges, which the plan's options must load with), device, dtype or quantization, ``seq_len`` beyond the
            model's context, or no ``device_memory`` for a CUDA plan on a machine without CUDA.
    """
    if device not in ("cpu", "cuda"):
        raise InvalidParameterError("device", device, "'cpu' or 'cuda'")
    target = torch.device(device)
    dtype = spelled_dtype(dtype)  # type: ignore[assignment]
    quantization = resolve_quantization(quantization, target, dtype,  # "auto": the engine's own choice
                                        model_config.native_format)
    dtype = format_dtype(quantization, target, dtype)
    resolved = (torch.bfloat16 if device == "cuda" else torch.float32) if dtype in (None, "auto") else (
        resolve_dtype(dtype, torch.device("cpu")))
    check_quantization(quantization, target, resolved)
    skip = resolve_skip(quantization, quantization_skip)
    context = model_config.max_position_embeddings
    seq_len = context if seq_len is None else seq_len
    # the engine's own ranges (EngineConfig): the plan's options must load; a seq_len of 1 is a max_model_len the
    # engine refuses (a prompt token and an output token), which the plan printed as flags to start it with; a batch
    # or step of more than MAX_BYTES (2**63 - 1) tokens or requests is more than any KV budget holds, and its bytes
    # overflowed the table's float sizes (an OverflowError, not a refusal)
    for name, value, low, high in (("batch", batch, 1, MAX_BYTES), ("seq_len", seq_len, 2, context),
                                   ("block_size", block_size, 1, 256), ("max_num_seqs", max_num_seqs, 1, MAX_NUM_SEQS),
                                   ("max_num_batched_tokens", max_num_batched_tokens, 1, MAX_BYTES)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise InvalidParameterError(name, value, f"an integer >= {low}{'' if high is None else f' and <= {high}'}")
    source = "given"
    if device_memory is None:
        device_memory, source = _measure(target)
    elif isinstance(device_memory, bool) or not isinstance(device_memory, int) or not 0 <= device_memory <= MAX_BYTES:
        raise InvalidParameterError("device_memory", device_memory, f"a byte count in [0, {MAX_BYTES}]")
    spec = KVCacheSpec.from_model_config(model_config, block_size=block_size, dtype=resolved, device=target)
    nbytes = spec.dtype_bytes
    plan = DeploymentPlan(
        model_name=model_name, model_config=model_config, device=device, dtype=resolved, quantization=quantization,
        batch=batch, seq_len=seq_len, block_size=block_size, spec=spec,
        weight_bytes=weight_bytes(model_config, nbytes, quantization, skip, target),
        kv_blocks=batch * blocks_for(seq_len, block_size), activation_bytes=0, overhead_bytes=OVERHEAD_BYTES[device],
        rope_bytes=rope_table_bytes(model_config),
        device_memory=device_memory, device_memory_source=source,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
    )
    activations = _fixed_activations(plan) + _prefill_bytes(plan, seq_len) + batch * _gather_bytes(spec, seq_len)
    plan = _replace(plan, activation_bytes=activations)
    return _replace(plan, suggestions=tuple(_suggestions(plan)))


def _measure(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidParameterError("device_memory", None, "a size such as 80GB for a CUDA plan (no CUDA device "
                                                               "here to measure)")
        return int(torch.cuda.get_device_properties(0).total_memory), "CUDA device 0's total"
    from asyncinfer.memory import available_memory

    return available_memory(device), "available RAM now"


def _replace(plan: DeploymentPlan, **changes: object) -> DeploymentPlan:
    import dataclasses

    return dataclasses.replace(plan, **changes)  # type: ignore[arg-type]


def _with_it(plan: DeploymentPlan) -> str:
    """What fits with a smaller format: a smaller batch, a shorter length, either, or not one request
    (a batch of 0 or a length below 2, which the engine refuses, is never offered)."""
    options = ([f"batch {plan.max_batch} at {plan.seq_len} tokens"] if plan.max_batch >= 1 else []) + (
        [f"max_model_len {plan.max_seq_len} at batch {plan.batch}"] if plan.max_seq_len >= 2 else [])
    return "with it, " + " or ".join(options) if options else "not one request fits even with it"


def _suggestions(plan: DeploymentPlan) -> list[str]:
    if plan.fits:
        return []
    out = []
    if plan.device == "cpu" and plan.dtype == torch.float32:
        for method in smaller_cpu_formats(plan.quantization):
            smaller = weight_bytes(plan.model_config, 4, method, default_skip(method))
            quantized = _replace(plan, weight_bytes=smaller)
            then = ("and the plan fits" if quantized.fits else
                    f"not enough alone: {_size(-quantized.headroom_bytes)} short; " + _with_it(quantized))
            out.append(f"--quantization {method}: weights {_size(plan.weight_bytes)} -> {_size(smaller)}, {then}")
    if plan.device == "cuda" and plan.dtype == torch.float32:
        out.append("--dtype bfloat16: half the weights and the KV cache")
    if plan.max_seq_len >= 2:  # a max_model_len the engine takes
        out.append(f"max_model_len {plan.max_seq_len} (the longest length at batch {plan.batch})")
    if plan.max_batch >= 1:
        out.append(f"batch {plan.max_batch} (the largest at {plan.seq_len} tokens)")
    if plan.max_batch < 1 and plan.max_seq_len < 2:
        out.append("a device with more memory, or a smaller model: not one request fits")
    if plan.rope_bytes > plan.device_memory // 2:
        out.append(f"a model with a shorter context: its rope tables alone need {_size(plan.rope_bytes)}, a row for "
                   f"each of its {plan.model_config.max_position_embeddings} positions (max_position_embeddings), "
                   "whatever max_model_len")
    return out
