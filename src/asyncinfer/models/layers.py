"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, fused MLP.

Numerics follow the Hugging Face implementations (RMSNorm in float32, rope in
the "rotate_half" convention) so that logits match transformers to ~1e-5 in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asyncinfer.models.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm of x [T, hidden] in float32, scaled by ``weight``, in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        # torch's own op: on a CPU, the same float32 steps as below (bit-identical), in one call.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # [T, hidden]
    dtype = x.dtype
    x32 = x.float()  # [T, hidden]
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # [T, hidden]
    return weight * x32.to(dtype)  # [T, hidden]


def silu_mul(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` for gate_up [T, 2 * I] (rows [gate; up]) -> [T, I].

    Computed in gate_up's gate half, which it overwrites (the MLP's own product, read once), and returned
    as a view of it (rows ``2 * I`` apart): the same values as ``F.silu(gate) * up``, without two new
    [T, I] tensors. On a CPU each new tensor of a long prefill chunk is fresh pages from the kernel
    (a 1B model's 1,024-token chunk: 32 MiB each), whose page faults cost more than the arithmetic
    (docs/formats.md, "A long prefill chunk's fresh memory").
    """
    gate, up = gate_up.split(intermediate_size, dim=-1)  # [T, I] each, views
    return F.silu(gate, inplace=True).mul_(up)  # [T, I], a view of gate_up


def silu_mul_new(gate_up: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """:func:`silu_mul` into a new tensor, gate_up unchanged (what ``torch_compile`` compiles: the compiled code
    makes one pass of its own)."""
    gate, up = gate_up.split(intermediate_size, dim=-1)  # [T, I] each
    return F.silu(gate) * up


NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ActFn = Callable[[torch.Tensor, int], torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference.

    ``fn``, fixed at construction: :func:`rms_norm`, or its ``torch.compile`` d form
    (the model passes its :class:`ElementwiseOps`' ``rms_norm``)."""

    def __init__(self, hidden_size: int, eps: float, fn: NormFn = rms_norm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._fn = fn

    @property
    def fn(self) -> NormFn:
        """The function this norm computes with (fixed at construction)."""
        return self._fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x, self.weight, self.eps)  # [T, hidden]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32, CPU) with the config's rope scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [D/2]
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [D/2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # positions effectively divided by factor
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)  # [D/2]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, config.rope_theta, dim, scaling)
    if rope_type == "longrope":
        raise ValueError("longrope has two sets of frequencies: longrope_inv_freq(config, 'short_factor' / 'long_factor')")
    raise ValueError(f"unknown rope type {rope_type!r}")  # ModelConfig validation prevents this


def longrope_inv_freq(config: ModelConfig, key: str) -> torch.Tensor:
    """Longrope's inverse frequencies [head_dim / 2] (float32, CPU) with ``key``'s factors (``"short_factor"`` or
    ``"long_factor"``): ``1 / (factor_i * theta ** (2i / head_dim))``, as transformers computes them."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [D/2]
    factors = torch.tensor(config.rope_scaling[key], dtype=torch.float32)  # [D/2]
    return 1.0 / (factors * config.rope_theta**exponents)  # [D/2]


def rope_attention_factor(config: ModelConfig) -> float:
    """What the cos/sin tables are multiplied by: 1, or YaRN's attention factor (given, or from ``factor``:
    ``0.1 * log(factor) + 1``, with ``mscale`` / ``mscale_all_dim`` the ratio of two such terms), or longrope's
    (given, or from ``factor``, by default ``max_position_embeddings / original_max_position_embeddings``:
    ``sqrt(1 + log(factor) / log(original_max_position_embeddings))``, 1 for a factor <= 1; the same for the
    short and the long factors, as transformers applies it)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factor = float(scaling["factor"])

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


def _yarn_inv_freq(inv_freq: torch.Tensor, base: float, dim: int, scaling: dict) -> torch.Tensor:
    """YaRN: the frequencies that turn fewer than ``beta_slow`` times over the original context are divided by
    ``factor`` (interpolated), those that turn more than ``beta_fast`` times are kept (extrapolated), and a
    linear ramp over the dimensions between blends the two."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:  # the dimension whose frequency turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]: 0 keeps
    keep = 1 - ramp
    return (inv_freq / factor) * (1 - keep) + inv_freq * keep  # [D/2]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 rope: slow (long-wavelength) frequencies divided by ``factor``,
    fast ones kept, and a smooth blend in between."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)  # [D/2]
    smooth = (old_ctx / wavelen - low) / (high - low)  # [D/2]
    blended = (1 - smooth) * scaled / factor + smooth * scaled  # [D/2]
    is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)  # [D/2]
    return torch.where(is_medium, blended, scaled)  # [D/2]


@dataclass(frozen=True)
class RopeRows:
    """Which row of a model's cos/sin tables (:class:`RotaryEmbedding`) each token of a request reads, fixed by
    the config (:meth:`of`): the runner asks it for each token's row (``StepBatch.positions``), the prefix cache
    which requests may share K/V (:meth:`long`), the engine core when a request must be computed again
    (:meth:`switches`).

    Every rope type but longrope has one table: a token reads the row of its position. Longrope rotates with its
    short or its long factors, and transformers picks them per forward: long when the forward's last position
    + 1 exceeds ``original_max_position_embeddings``. Phi-3's ``generate()`` keeps a sequence on one set: when it
    first grows past the original context (the forward for the token at position ``original``), it drops its
    cache and computes the whole sequence again, with the long factors. So a request is rotated entirely with the
    short factors while it holds at most ``original`` tokens and entirely with the long ones once it holds more
    (its K are computed again at the switch: the engine core preempts it, :meth:`switches`). The tables hold
    ``max_positions`` rows (short below ``original``, long from it) and, after them, ``original`` rows of long
    factors for the positions below it: a long request's tokens there read row ``max_positions + position``.
    A token's row depends on its position and its request's length only, never on the step it runs in: the same
    for a chunked prefill, a batch, a preempted request computed again; and a decode's row is its position
    (a decode at position ``p`` belongs to a request of ``p + 1`` tokens), which the kernels' one-call decode
    step reads as it reads any rope.

    ``original``: longrope's original context where it is shorter than ``max_positions``, else 0 (one table:
    a longrope model whose context is not longer than its original one never uses its long factors).
    """

    max_positions: int
    original: int = 0

    @classmethod
    def of(cls, config: ModelConfig) -> RopeRows:
        """The rows of ``config``'s rope tables."""
        scaling = config.rope_scaling
        original = 0
        if scaling is not None and scaling["rope_type"] == "longrope":
            original = int(scaling["original_max_position_embeddings"])
            original = original if original < config.max_position_embeddings else 0
        return cls(config.max_position_embeddings, original)

    @property
    def num_rows(self) -> int:
        """Rows of the cos/sin tables."""
        return self.max_positions + self.original

    def long(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens (prompt and output) rotates with the long factors (its K
        below the original context differ from a shorter request's on the same tokens: another prefix-cache group)."""
        return 0 < self.original < num_tokens

    def switches(self, num_tokens: int) -> bool:
        """Whether a request that has just grown to ``num_tokens`` tokens by a sampled one must be computed again:
        it has just passed the original context, and its K were rotated with the short factors."""
        return 0 < self.original == num_tokens - 1

    def extend(self, rows: list[int], num_tokens: int, start: int, end: int) -> None:
        """Append the rows of positions ``start .. end - 1`` of a request of ``num_tokens`` tokens."""
        if start >= self.original or not self.long(num_tokens):
            rows.extend(range(start, end))
            return
        cut = min(end, self.original)
        rows.extend(range(start + self.max_positions, cut + self.max_positions))
        rows.extend(range(cut, end))


def rope_table_bytes(config: ModelConfig) -> int:
    """The bytes that building ``config``'s model's rope tables takes at its peak, from the config alone: the float32
    cos and sin tables of every :class:`RotaryEmbedding` it holds (Gemma 3: a second one for its sliding layers), the
    angles and the positions they are computed from. A row a position up to ``max_position_embeddings``, whatever
    ``max_model_len`` the engine runs with."""
    rows = RopeRows.of(config)
    table = rows.num_rows * (config.head_dim // 2) * 4
    tables = 2 if config.sliding_rope_theta is not None else 1
    return (2 * tables + 2) * table + 12 * rows.max_positions


def rope_angles(config: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """The angle of every row of the rope tables, ``position * inv_freq`` float32 [RopeRows.of(config).num_rows,
    head_dim / 2], laid out as :class:`RopeRows` says."""
    rows = RopeRows.of(config)
    pos = torch.arange(rows.max_positions, device=device, dtype=torch.int64).float()  # [P]
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "longrope":
        return torch.outer(pos, rope_inv_freq(config).to(device))  # [P, D/2]
    short = longrope_inv_freq(config, "short_factor").to(device)  # [D/2]
    long = torch.outer(pos, longrope_inv_freq(config, "long_factor").to(device))  # [P, D/2]
    original = rows.original or rows.max_positions  # 0: short factors on every position
    below = torch.outer(pos[:original], short)  # [original, D/2]
    return torch.cat((below, long[original:], long[: rows.original]))  # [P + rows.original, D/2]


class RotaryEmbedding(nn.Module):
    """Cos/sin tables: a row for every position up to ``max_position_embeddings`` (and for longrope, the rows of
    :class:`RopeRows`).

    The table is a non-persistent buffer: it is not in checkpoints, and the
    loader rebuilds it on the target device with :meth:`materialize`.
    ``cos_sin(positions)`` is looked up once per forward and shared by all
    layers; positions (the rows of :class:`RopeRows`) are arbitrary per token (flattened batches).
    """

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.materialize(device)

    def materialize(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables on ``device`` in float32 (also replaces meta tensors)."""
        # Default: the current default device, so that building the model under
        # ``with torch.device("meta")`` allocates nothing.
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type == "meta":
            shape = (RopeRows.of(self.config).num_rows, self.config.head_dim // 2)
            self.cos_cache = torch.empty(shape, device=device)
            self.sin_cache = torch.empty(shape, device=device)
            return
        freqs = rope_angles(self.config, device)  # [rows, D/2]
        # Only half the dimensions are stored: rotate_half's cos/sin repeat them. YaRN and longrope scale both.
        scale = rope_attention_factor(self.config)
        self.cos_cache = freqs.cos() * scale if scale != 1.0 else freqs.cos()  # [rows, D/2]
        self.sin_cache = freqs.sin() * scale if scale != 1.0 else freqs.sin()  # [rows, D/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos and sin for each token (``positions``: its row, :class:`RopeRows`), shaped to broadcast over heads:
        [T, 1, D/2] each."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)  # [T, 1, D/2]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] with the rotate_half convention; returns a new tensor.

    Equivalent to ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, heads, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, heads, D]


@dataclass(frozen=True)
class ElementwiseOps:
    """The element-wise functions a decoder computes with between its projections, chosen once, at load.

    A model family's class takes one at construction and hands each function to the layers that use
    it; nothing replaces them afterwards. The defaults are the eager functions of this module;
    ``torch_compile=True`` builds the record of their compiled forms
    (:func:`asyncinfer.models.torch_compile.compile_elementwise_ops`) before the model is built.
    """

    rms_norm: NormFn = rms_norm  # (x [T, hidden], weight [hidden], eps) -> [T, hidden]
    apply_rope: RopeFn = apply_rope  # (x [T, heads, D], cos [T, 1, D/2], sin [T, 1, D/2]) -> [T, heads, D]
    silu_mul: ActFn = silu_mul  # (gate_up [T, 2 * I], I) -> [T, I]; may overwrite gate_up


#: The eager functions: what a model is built with unless ``torch_compile=True``.
EAGER_OPS = ElementwiseOps()


#: On a CPU, the most bytes of gate_up product an MLP makes at once: a step of more rows (a long prefill chunk) runs
#: its MLP on slices of rows. A larger product is served by the C library as fresh pages from the kernel at every
#: layer (glibc maps blocks of 32 MiB and more anew each time), whose page faults cost more than the arithmetic
#: (a 1B model's 1,024-token chunk: 64 MiB a layer; docs/formats.md, "A long prefill chunk's fresh memory").
MLP_SLICE_BYTES = 16 * 2**20
#: The fewest rows of a slice (beyond PANEL_MIN_ROWS = 9, so that a slice takes the same kernels as the whole).
MLP_SLICE_MIN_ROWS = 64


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul.

    ``act``, fixed at construction: :func:`silu_mul` or its compiled form (``ElementwiseOps.silu_mul``).
    On a CPU a step whose gate_up product would pass :data:`MLP_SLICE_BYTES` runs on slices of its rows: the same
    result to the last bit with the kernels' block formats, whose GEMMs take each row alone (torch's float GEMM may
    round a row differently at another row count, as at any other batch)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: ActFn = silu_mul) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # rows: [gate; up]
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._act = act

    @property
    def act_fn(self) -> ActFn:
        """The activation this MLP computes with (fixed at construction)."""
        return self._act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        product = rows * 2 * self.intermediate_size * 4  # float32 gate_up
        if x.device.type != "cpu" or product <= MLP_SLICE_BYTES or rows < 2 * MLP_SLICE_MIN_ROWS:
            return self._rows(x)  # [T, hidden]
        slices = min(-(-product // MLP_SLICE_BYTES), rows // MLP_SLICE_MIN_ROWS)
        return torch.cat([self._rows(part) for part in x.tensor_split(slices)])  # [T, hidden]

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        return self.down_proj(self._act(gate_up, self.intermediate_size))  # [T, hidden]
