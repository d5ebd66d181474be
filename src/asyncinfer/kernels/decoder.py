"""The decoder in one kernel call: :class:`DecodeLayer` (one Llama-family or Gemma layer for a step of decodes) and
:class:`DecodeStack` (every layer, the final norm and the head)."""

from __future__ import annotations

import ctypes
import operator
from array import array
from collections.abc import Callable
from itertools import chain
from typing import Literal, NamedTuple

import torch

from asyncinfer.kernels._build import lib as _need
from asyncinfer.kernels._checks import MAX_BYTES, bounded, contiguous, memory, real, size, tensor
from asyncinfer.kernels._checks import softcap as _softcap
from asyncinfer.kernels.formats import (
    _ACT8,
    _TILE8,
    LANE_ROWS,
    LANES16,
    LANES_FORMATS,
    LAYOUTS,
    BlockTable,
    activation_dtype_flag,
    activation_dtype_name,
    format_name,
)
from asyncinfer.kernels.formats import check_blocks as _check_blocks
from asyncinfer.kernels.ops import (
    EmbedTable,
    _check,
    _check_paged,
    _check_timing,
    _raise_paged,
    check_cache_size,
    check_context,
    check_width,
    embed_table,
    longest,
)
from asyncinfer.kernels.ops import embed_scale as _embed_scale

_FORMAT_CODES = {name: layout.code for name, layout in LAYOUTS.items()}
#: The MLP activations the kernels' layer computes (``layer_t``'s ``act``, ASYNCINFER_ACT_*): SwiGLU's silu, GeGLU's
#: gelu with the tanh approximation (Gemma).
Activation = Literal["silu", "gelu_tanh"]
_ACTIVATION_CODES: dict[str, int] = {"silu": 0, "gelu_tanh": 1}
#: The most rope tables a stack's layers may read (Gemma 3: the full layers' and the sliding layers').
MAX_ROPE_TABLES = 2
_MAX_FLOATS = MAX_BYTES // 4
#: A step's rope tables (cos or sin): one float32 tensor [positions, head_dim / 2] where every layer reads the same,
#: else a tuple of one tensor per rope table (:attr:`DecodeStack.rope_tables`).
RopeTables = torch.Tensor | tuple[torch.Tensor, ...]
#: The most runs of rows (each in its own format) a projection may have (ASYNCINFER_MAX_PARTS).
MAX_PARTS = 3


class _Part(ctypes.Structure):
    """``part_t`` in asyncinfer_kernels.h: a run of a projection's output rows in one format."""

    _fields_ = [("w", ctypes.c_void_p), ("rows", ctypes.c_int64), ("fmt", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


_Parts = _Part * MAX_PARTS


def _weights_format(fmt: object, what: str, flag: int, step_tile: bool = True) -> tuple[str, str, int]:
    """A projection's format name as a layer or stack takes it: ``(name, the block format its blocks are sized as,
    the kernels' code with ``flag``)``; a name of :data:`LANES_FORMATS` (Q4_0 / Q4_1 in lanes) with int8 activations
    only, every other name one of the block formats (:func:`format_name`'s errors). ``step_tile``: with int8, a plain
    format's code carries the tile flag (the tile from STEP_TILE_MIN_ROWS rows on: a layer's projections, and the head
    of a stack whose layers are not all in lanes); without it the rows at every count (the head over layers all in
    lanes, so that a request's logits stay the same bits whatever its step holds)."""
    if isinstance(fmt, str) and str.__str__(fmt) in LANES_FORMATS:
        name = str.__str__(fmt)
        if not flag & _ACT8:
            raise ValueError(f"{what}: {name!r} ({LANES_FORMATS[name]} in lanes) is multiplied with int8 activations "
                             f"only, and activation_dtype is not 'int8'")
        # with the tile flag: the tile over the lanes from 32 rows on (a step of many decodes), the same results
        return name, LANES_FORMATS[name], _FORMAT_CODES[LANES_FORMATS[name]] | LANES16 | _TILE8 | flag
    name = format_name(fmt, what)
    # int8: the tile flag, so a step of STEP_TILE_MIN_ROWS rows or more takes the tile (AVX-512 variants), fewer the rows
    return name, name, _FORMAT_CODES[name] | flag | (_TILE8 if flag & _ACT8 and step_tile else 0)


def _check_lanes(name: str, fmt: str, rows: int) -> None:
    """ValueError naming ``name`` where a format in lanes holds a row count that is not a multiple of 16."""
    if fmt in LANES_FORMATS and rows % LANE_ROWS:
        raise ValueError(f"{name}: {LANES_FORMATS[fmt]} in lanes holds a multiple of {LANE_ROWS} rows, got {rows}")


class _Layer(ctypes.Structure):
    """``layer_t`` in asyncinfer_kernels.h: one layer's weights (raw pointers) and shape."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("b_qkv", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("post_norm1", ctypes.c_void_p),
                ("post_norm2", ctypes.c_void_p), ("qkv", _Parts), ("o", _Parts), ("gate_up", _Parts), ("down", _Parts),
                ("hidden", ctypes.c_int64), ("H", ctypes.c_int64), ("KVH", ctypes.c_int64), ("D", ctypes.c_int64),
                ("I", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("act", ctypes.c_int32), ("rope", ctypes.c_int32), ("window", ctypes.c_int64)]


def _projection_parts(name: str, spec: object, rows: int, k: int, flag: int = 0) -> tuple[_Parts, tuple]:
    """A projection ``(format, blocks, bias or None)`` checked and as the kernel takes it: its parts, and the
    spec as the plain tuples and format names it holds (what the layer keeps: a tuple subclass's ``__iter__``,
    ``__len__`` or ``__getitem__`` could show the checks one set of blocks and the layer another, a ``str``
    subclass one format to the checks and another to the kernel). ``format`` / ``blocks``: one format name and its
    blocks [rows, ...], or (a projection whose rows are in several formats, e.g. q and k in Q4_K and v in Q6_K) a
    tuple of 1 to :data:`MAX_PARTS` names and a tuple as long of blocks, whose row counts add up to ``rows``.
    ``flag``: put on every part's format code (:func:`~asyncinfer.kernels.formats.activation_dtype_flag`).
    TypeError / ValueError naming ``name``."""
    spec = tuple(spec) if isinstance(spec, tuple) else spec  # the items it holds, read once
    if not isinstance(spec, tuple) or len(spec) != 3:
        raise TypeError(f"{name} must be a tuple (format, blocks, bias or None), got {type(spec).__name__}")
    fmt, blocks, bias = spec
    single = isinstance(fmt, str)
    if single:
        fmts, runs = (fmt,), (blocks,)
    elif isinstance(fmt, tuple) and isinstance(blocks, tuple):
        fmts, runs = tuple(fmt), tuple(blocks)  # the names and blocks they hold
    else:
        fmts = runs = ()
    if not 1 <= len(fmts) == len(runs) <= MAX_PARTS:
        raise TypeError(f"{name}: the format must be a block format name (with one blocks tensor) or a tuple of 1 "
                        f"to {MAX_PARTS} names with a tuple as long of blocks tensors, got {type(fmt).__name__} and "
                        f"{type(blocks).__name__}")
    parts = _Parts()
    done = 0
    named = [_weights_format(f, f"{name if len(fmts) == 1 else f'{name}[{i}]'}'s format", flag)
             for i, f in enumerate(fmts)]
    fmts = tuple(n for n, _, _ in named)
    for i, ((f, sized, code), b) in enumerate(zip(named, runs)):
        part = name if len(fmts) == 1 else f"{name}[{i}]"
        n = rows
        if len(fmts) > 1:  # each part's rows are its blocks' (checked against the total below)
            tensor(part, b, torch.uint8, f"of {sized} blocks")
            n = b.shape[0] if b.dim() == 2 else -1
        _check_blocks(b, sized, n, k, part)
        _check_lanes(part, f, n)
        parts[i] = _Part(b.data_ptr(), n, code, 0)
        done += n
    if done != rows:
        raise ValueError(f"{name}: its parts hold {done} rows, the layer's shape needs {rows}")
    return parts, (fmts[0], runs[0], bias) if single else (fmts, runs, bias)



def _views(blocks: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A projection's blocks (one tensor, or a tuple of its parts') as views sharing their memory."""
    return tuple(b.detach() for b in blocks) if isinstance(blocks, tuple) else blocks.detach()


class DecodeLayer:
    """One Llama-family or Gemma decoder layer for a step of decodes, in a single kernel call
    (``asyncinfer_decode_layer``): norms, projections, rope, the K/V write, attention over the paged
    cache and SwiGLU (or GeGLU), each the same computation as the engine's kernels run op by op.

    Built once per layer from its weights (held here: views of the blocks, copies of the norms and the
    bias; resizing the blocks' memory in place afterwards is not detected, see docs/api.md); called per step with
    the residual stream ``h`` [T, hidden] (float32, contiguous, updated in place and returned).
    ``qkv``, ``o``, ``gate_up``, ``down``: each ``(format, blocks, bias or None)``, blocks as
    :func:`gemm` takes them (``pack(quantize(w, format), format)``; ``qkv`` the q, k and v rows one
    after another, ``gate_up`` the gate rows then the up rows), in any block format; or, for a projection
    whose rows are in several formats (a Q4_K_M file's q and k in Q4_K, v in Q6_K),
    ``((format, ...), (blocks, ...), bias or None)``: 1 to :data:`MAX_PARTS` runs of rows, one after another,
    each in its own format. A format may also be a name of :data:`~asyncinfer.kernels.formats.LANES_FORMATS`, Q4_0
    or Q4_1 in lanes (:func:`~asyncinfer.kernels.formats.pack_lanes`; with ``activation_dtype="int8"`` only, a
    multiple of 16 rows),
    which the step multiplies by the lanes' GEMM (from 32 decodes on by the int8 tile reading the lanes, where the
    build has it: the same results). Norms float32 [hidden]; only ``qkv`` may have a bias (float32
    [rows]).
    ``q_norm`` / ``k_norm`` (Qwen3): float32 [head_dim] each, or both None: every q and k head RMS-normalised
    over its head_dim values (with ``eps``, weights shared by the heads) between the projection and rope.

    Gemma's parts (defaults: the Llama layer, none of this work done): ``post_norm1`` / ``post_norm2``, float32
    [hidden] or None: the attention's / the MLP's output RMS-normalised (``eps``) before it is added to ``h``
    (``norm2`` is then Gemma's pre-MLP norm); ``activation``: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU,
    torch's ``F.gelu(approximate="tanh")``); ``attn_softcap``: None, or a positive cap each attention score
    (``scale`` included) is soft-capped at, ``cap * tanh(s / cap)`` (Gemma 2); ``rope_table``: which of a
    :class:`DecodeStack`'s rope tables the layer reads, 0 to ``MAX_ROPE_TABLES - 1`` (Gemma 3's sliding layers:
    1, their own rope base; a layer called alone takes its rope rows directly). A norm's weights are what the
    normalised values are multiplied by: a family's weight offset (Gemma's ``1 + w``) added by the caller.
    ``window``: None, or a positive int: each token attends to the last ``window`` keys of its context only (its
    own included; a sliding-window layer), as the torch reference's window masks them.
    ``activation_dtype``: how the projections round a step's activations, ``"int16"`` or ``"int8"`` (as :func:`gemm`'s
    ``activation_dtype``); ``"bfloat16"`` is taken as int16 (:func:`gemm` multiplies in bfloat16 only from
    ``BF16_MIN_ROWS`` rows on, a prefill's, which the layer's kernel does not run); ValueError for another value.
    With int8 a projection in a plain block format is multiplied by the rows below
    :data:`~asyncinfer.kernels.STEP_TILE_MIN_ROWS` rows and by the int8 tile from it on (AVX-512 variants; the rows
    elsewhere), each row's result the same whatever the others on either side; the two sum in another order, so a
    row's result moves in its last bits when its step crosses that count.

    Everything is checked here, once: TypeError naming the argument for a tensor not on the CPU, of
    another dtype or kind of shape, or a projection that is not such a tuple; ValueError for a size
    outside its range (heads, KV heads, intermediate size and hidden size >= 1, head_dim a positive
    multiple of 8, heads a multiple of the KV heads) and for weights that disagree with these sizes.
    """

    def __init__(self, *, norm1: torch.Tensor, norm2: torch.Tensor, eps: float, qkv: tuple, o: tuple,
                 gate_up: tuple, down: tuple, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, scale: float, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, post_norm1: torch.Tensor | None = None,
                 post_norm2: torch.Tensor | None = None, activation: Activation = "silu",
                 attn_softcap: float | None = None, rope_table: int = 0, window: int | None = None,
                 activation_dtype: str = "int16") -> None:
        activation_dtype = activation_dtype_name(activation_dtype, "activation_dtype")
        flag = activation_dtype_flag(activation_dtype)
        heads, kv_heads = size("num_heads", num_heads), size("num_kv_heads", num_kv_heads)
        if heads % kv_heads:
            raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}")
        head_dim = size("head_dim", head_dim, 8, 2**31)
        if head_dim % 8:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 8 (the attention kernel's vectors)")
        inter = size("intermediate_size", intermediate_size)
        eps, scale = real("eps", eps), real("scale", scale)
        for name, t in (("norm1", norm1), ("norm2", norm2), ("post_norm1", post_norm1), ("post_norm2", post_norm2)):
            if t is None and name.startswith("post_"):
                continue
            tensor(name, t, torch.float32, "[hidden]")
            if t.dim() != 1 or not t.is_contiguous() or t.shape != norm1.shape:
                raise TypeError(f"{name} must be contiguous float32 [hidden] like norm1, got {tuple(t.shape)}")
        if isinstance(activation, str):  # the plain str it holds: a subclass's __hash__ / __eq__ may lie or raise
            activation = str.__str__(activation)
        if not isinstance(activation, str) or activation not in _ACTIVATION_CODES:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATION_CODES)}, got {activation!r}")
        softcap = 0.0
        if attn_softcap is not None:
            softcap = _softcap("attn_softcap", attn_softcap)
        rope_table = size("rope_table", rope_table, 0, MAX_ROPE_TABLES - 1)
        window_keys = 0 if window is None else size("window", window, 1, 2**62)
        hidden = size("hidden (norm1's size)", norm1.shape[0])
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm go together (Qwen3's per-head norms of q and k): give both or neither")
        for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
            if t is not None:
                tensor(name, t, torch.float32, f"[head_dim={head_dim}]")
                if t.dim() != 1 or t.shape[0] != head_dim:
                    raise ValueError(f"{name} must be float32 [head_dim={head_dim}], got {tuple(t.shape)}")
        self._head_dim, self._kv_heads = head_dim, kv_heads
        parts, specs = {}, {}
        for name, spec, n, k in (("qkv", qkv, q_size + 2 * kv_size, hidden), ("o", o, hidden, q_size),
                                 ("gate_up", gate_up, 2 * inter, hidden), ("down", down, hidden, inter)):
            parts[name], specs[name] = _projection_parts(name, spec, n, k, flag)
            bias = specs[name][2]
            if bias is not None and name != "qkv":
                raise ValueError(f"{name} must have no bias (the kernel adds one to q/k/v only)")
            if bias is not None:
                tensor("qkv bias", bias, torch.float32)
                if not bias.is_contiguous() or bias.numel() != n:
                    raise ValueError(f"qkv bias must be contiguous float32 [{n}], got {tuple(bias.shape)}")
        # What the kernel's pointers address is held here: private copies of the norms and the bias (a few KB),
        # views of the blocks (sharing their memory: a caller's ``set_`` on a tensor it passed cannot free it).
        norm1, norm2 = norm1.detach().clone(), norm2.detach().clone()
        q_norm, k_norm, post_norm1, post_norm2 = (None if t is None else t.detach().contiguous().clone()
                                                  for t in (q_norm, k_norm, post_norm1, post_norm2))
        qkv, o, gate_up, down = ((spec[0], _views(spec[1]), None if spec[2] is None else spec[2].detach().clone())
                                 for spec in specs.values())  # the parts' pointers: the same memory (as checked)
        # qkv / o / gate_up / down: (format, blocks, bias or None).
        self._args = {"norm1": norm1, "norm2": norm2, "eps": eps, "qkv": qkv, "o": o, "gate_up": gate_up,
                      "down": down, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                      "intermediate_size": intermediate_size, "scale": scale, "q_norm": q_norm, "k_norm": k_norm,
                      "post_norm1": post_norm1, "post_norm2": post_norm2, "activation": activation,
                      "attn_softcap": attn_softcap, "rope_table": rope_table, "window": window,
                      "activation_dtype": activation_dtype}
        #: The most floats one token needs in any of the layer's buffers (bounds a step's working memory).
        self._widest = max(hidden, q_size + 2 * kv_size, 2 * inter, q_size, inter)
        self._hidden = hidden
        self._rope_table = rope_table
        self._in_lanes = all(f in LANES_FORMATS for spec in specs.values()
                             for f in ((spec[0],) if isinstance(spec[0], str) else spec[0]))
        self._struct = _Layer(
            norm1.data_ptr(), norm2.data_ptr(), None if qkv[2] is None else qkv[2].data_ptr(),
            *(None if t is None else t.data_ptr() for t in (q_norm, k_norm, post_norm1, post_norm2)), parts["qkv"],
            parts["o"], parts["gate_up"], parts["down"], hidden, heads, kv_heads, head_dim, inter, eps, scale, softcap,
            _ACTIVATION_CODES[activation], rope_table, window_keys)
        #: None, or float64 [3] that each call adds its seconds to: projections, attention, the whole
        #: layer (set by a profiler, e.g. ``benchmarks/throughput.py --profile``; see :meth:`time_parts`).
        self.timing: torch.Tensor | None = None

    @property
    def activation_dtype(self) -> str:
        """How the layer's projections round a step's activations (``"int16"``, ``"int8"``, or ``"bfloat16"``: int16's
        here)."""
        return self._args["activation_dtype"]

    @property
    def in_lanes(self) -> bool:
        """Whether every part of the layer's projections is held in lanes (a format of :data:`LANES_FORMATS`): a
        step then multiplies them with the same float32 operations at every count, and a :class:`DecodeStack` whose
        layers all are keeps its head on the rows at every count too (elsewhere a plain part already moves a
        request's logits when its steps cross :data:`~asyncinfer.kernels.STEP_TILE_MIN_ROWS` rows)."""
        return self._in_lanes

    def time_parts(self, on: bool = True) -> None:
        """Start (zeroed) or stop adding up where this layer's calls spend their time."""
        self.timing = torch.zeros(3, dtype=torch.float64) if on else None

    def __deepcopy__(self, memo: dict) -> DecodeLayer:
        # The raw pointers must follow the copied tensors (the same copies the copied layers hold).
        import copy

        return DecodeLayer(**copy.deepcopy(self._args, memo))

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step of this layer: h float32 [T, hidden]; cos/sin float32 [T, (1,) head_dim / 2],
        the rope rows of each token's position; caches float32 [blocks, block_size, KV heads, head_dim];
        slots / context_lens int64 [T]; block_tables int64 [T, n]. Returns h, updated in place.

        Raises TypeError naming the parameter for tensors not on the CPU or of another dtype (h, cos, sin,
        caches float32; slots, block_tables, context_lens int64); ValueError for shapes that disagree with
        the layer (h's width, the rope rows, the caches' KV heads and head_dim) or each other (one slot, context
        length and table row per row of h), caches of no block or slot; IndexError for a
        context, slot or block outside the caches."""
        lib = _need()
        for name, t in (("h", h), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
            tensor(name, t, torch.float32)
        num_tokens = h.shape[0] if h.dim() == 2 else -1
        half = self._head_dim // 2
        kv_shape = (self._kv_heads, self._head_dim)
        if h.dim() != 2 or h.shape[1] != self._hidden:
            raise ValueError(f"h must be float32 [T, {self._hidden}], got {h.dtype} {tuple(h.shape)}")
        if num_tokens * self._widest > _MAX_FLOATS:
            bounded("h (the step's working memory)", num_tokens, self._widest, 4)
        for name, t in (("cos", cos), ("sin", sin)):
            if not t.is_contiguous() or t.numel() != num_tokens * half:
                raise ValueError(f"{name} must be contiguous float32 [{num_tokens}, {half}], got {t.dtype} "
                                 f"{tuple(t.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not t.is_contiguous() or t.dim() != 4 or tuple(t.shape[2:]) != kv_shape or t.shape != k_cache.shape:
                raise ValueError(f"{name} must be contiguous float32 [blocks, block_size, {kv_shape[0]}, "
                                 f"{kv_shape[1]}] like k_cache, got {t.dtype} {tuple(t.shape)}")
        if not isinstance(context_lens, torch.Tensor) or context_lens.numel() != num_tokens:
            tensor("context_lens", context_lens, torch.int64)  # slots and block_tables: as many (_check_paged)
            raise ValueError(f"context_lens must have one entry per row of h ({num_tokens}), got "
                             f"{tuple(context_lens.shape)}")
        _check_timing(self.timing, 3, "DecodeLayer")
        if not h.is_contiguous():
            h = contiguous(h, "h")
        if not (isinstance(block_tables, torch.Tensor) and isinstance(slots, torch.Tensor)):  # None included
            tensor("slots", slots, torch.int64)
            tensor("block_tables", block_tables, torch.int64)
        tables = block_tables if block_tables.is_contiguous() else contiguous(block_tables, "block_tables")
        _check_paged(lib, tables, context_lens, slots, k_cache)
        if not num_tokens:  # an empty step stays empty
            return h
        if torch.autograd.profiler._is_profiler_enabled:  # one op per layer in a trace
            with torch.profiler.record_function("asyncinfer::decode_layer"):
                return self._call(lib, h, cos, sin, k_cache, v_cache, slots, tables, context_lens)
        return self._call(lib, h, cos, sin, k_cache, v_cache, slots, tables, context_lens)

    def _call(self, lib: ctypes.CDLL, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor
              ) -> torch.Tensor:
        _check(lib.asyncinfer_decode_layer(
            ctypes.byref(self._struct), h.data_ptr(), h.shape[0], cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], context_lens.data_ptr(),
            k_cache.shape[1], torch.get_num_threads(), None if self.timing is None else self.timing.data_ptr()),
            "decode_layer")
        return h


_data_ptr = torch.Tensor.data_ptr


class _Tables(NamedTuple):
    """A DecodeStack's embedding and rope tables, as last checked: pointers, sizes, the embedding as the kernel
    reads its rows (``kernel``: a BlockTable in any block format or a float32 table, dequantized into the step's
    residual stream by the call itself) or, for any other float table, ``rows``: the function that makes the step's
    rows, float32 [T, hidden], from the token ids; and the tables (their identity). The rope tables: one cos and one
    sin table per rope table the layers read (``cos`` / ``sin``: their pointers as the C call takes them)."""

    addresses: tuple[int, ...]  # the embedding's memory, then every cos table's, then every sin table's
    cos: ctypes.Array
    sin: ctypes.Array
    vocab: int
    positions: int
    kernel: EmbedTable | None
    rows: Callable[[torch.Tensor], torch.Tensor] | None
    embed_tensor: torch.Tensor | BlockTable
    cos_tensor: tuple[torch.Tensor, ...]
    sin_tensor: tuple[torch.Tensor, ...]
    #: The three tables' shapes, dtypes and strides as checked, and a BlockTable's format and layout (a change
    #: in place, a resize or a dtype view, is checked again).
    layout: tuple


def _float_rows(table: torch.Tensor, scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rows of a float embedding table the kernel does not read itself (another dtype, values not contiguous in
    a row), as float32, times ``scale`` (unless 1)."""

    def rows(ids: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.embedding(ids, table).float()
        return out if scale == 1.0 else out.mul_(scale)

    return rows


class DecodeStack:
    """Every decoder layer of a model and its final norm, for a step of decodes, in one kernel call
    (``asyncinfer_decode_stack``): the embedding rows, the rope rows for each position, each layer as
    :class:`DecodeLayer` runs it, the final RMS norm and, with a ``head``, the logits. One call per
    step instead of one per layer, and none of torch's per-op cost between them.

    ``layers``: the model's DecodeLayers in order (kept here, with the weights they point to);
    ``final_norm`` / ``eps``: the model's last norm; ``head``: None, or the output projection as
    ``(format, blocks, out_features)`` (blocks as :func:`gemm` takes them; ``format`` as a layer's, the lanes
    names included); ``embed_scale``: what each embedding
    row is multiplied by before the first layer, in float32 (a family's embedding scale, Gemma's
    ``sqrt(hidden)``; 1: the rows as stored), a finite real number; ``logit_softcap``: None, or a positive cap
    each logit is soft-capped at, ``cap * tanh(logit / cap)``, before its argmax (Gemma 2's final soft-capping);
    ``activation_dtype``: how the head rounds its activations, ``"int16"`` or ``"int8"`` (as :func:`gemm`'s;
    ``"bfloat16"`` taken as int16, as :class:`DecodeLayer` takes it; with int8 the head takes the tile from
    :data:`~asyncinfer.kernels.STEP_TILE_MIN_ROWS` rows on, as the layers' projections in a plain block format do,
    unless every layer is held in lanes (:attr:`DecodeLayer.in_lanes`), whose steps give a request's logits the same
    bits at every count: then the head keeps the rows at every count; a head in lanes multiplies as a layer's
    projection in lanes does, the same bits at every count).

    Rope tables: each call takes one cos and one sin table per rope table its layers read
    (:class:`DecodeLayer`'s ``rope_table``; :attr:`rope_tables` of them): a tensor each where every layer reads
    table 0 (the Llama families), else tuples (Gemma 3: the full layers' tables, then the sliding layers').
    """

    def __init__(self, layers: list[DecodeLayer], final_norm: torch.Tensor, eps: float,
                 head: tuple[str, torch.Tensor, int] | None = None, *, embed_scale: float = 1.0,
                 logit_softcap: float | None = None, activation_dtype: str = "int16") -> None:
        self._activation_dtype = activation_dtype_name(activation_dtype, "activation_dtype")
        self._head_flag = activation_dtype_flag(self._activation_dtype)
        self._head_code = 0  # the head's format code with the flag (set below where there is a head)
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"layers must be a list of DecodeLayer, got {type(layers).__name__}")
        layers = list(layers)
        if not layers:
            raise ValueError("layers: DecodeStack needs at least one layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, DecodeLayer):
                raise TypeError(f"layers[{i}] must be a DecodeLayer, got {type(layer).__name__}")
            shape = (layer._hidden, layer._head_dim, layer._kv_heads)
            first = (layers[0]._hidden, layers[0]._head_dim, layers[0]._kv_heads)
            if shape != first:
                raise ValueError(f"layers[{i}] has (hidden, head_dim, KV heads) {shape}, layers[0] {first}: the layers "
                                 f"of a stack share them (one residual stream, one cache shape)")
        hidden = layers[0]._hidden
        tensor("final_norm", final_norm)
        if final_norm.dim() != 1 or final_norm.shape[0] != hidden or not final_norm.is_floating_point():
            raise TypeError(f"final_norm must be floating-point [hidden={hidden}], got {final_norm.dtype} "
                            f"{tuple(final_norm.shape)}")
        eps = real("eps", eps)
        scale = _embed_scale(embed_scale)
        softcap = 0.0
        if logit_softcap is not None:
            softcap = _softcap("logit_softcap", logit_softcap)
        if head is not None:
            head = tuple(head) if isinstance(head, tuple) else head  # the items it holds, read once
            if not isinstance(head, tuple) or len(head) != 3:
                raise TypeError(f"head must be None or a tuple (format, blocks, out_features), got "
                                f"{type(head).__name__}")
            fmt, blocks, out_features = head
            # the plain name: the kernel reads the blocks as this one
            # the tile from STEP_TILE_MIN_ROWS rows, as the layers' plain formats take it; over layers all in lanes,
            # the rows
            lanes = all(layer.in_lanes for layer in layers)
            fmt, sized, self._head_code = _weights_format(fmt, "head's format", self._head_flag, step_tile=not lanes)
            out_features = size("head's out_features", out_features)
            _check_blocks(blocks, sized, out_features, hidden, "head")
            _check_lanes("head", fmt, out_features)
            head = (fmt, blocks, out_features)
        #: The layers and the head the kernel's pointers address (read-only: the array below is built from them).
        self._layers = tuple(layers)
        self._head = head if head is None else (head[0], head[1].detach(), head[2])
        self._widest = max(layer._widest for layer in layers)
        self._norm = final_norm.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        self._eps = eps
        self._embed_scale = scale
        self._logit_softcap = logit_softcap
        self._softcap = softcap
        #: How many rope tables the layers read (a call's cos / sin: this many tables each).
        self._rope_tables = max(layer._rope_table for layer in layers) + 1
        self._array = (_Layer * len(self._layers))(*(layer._struct for layer in self._layers))
        # The caches as last checked: their tensors (k0, v0, k1, ...), layer 0's K address, their pointers.
        # The caches as last checked: their tensors (k0, v0, k1, ...), every one's data pointer, their pointers
        # for the C call, and layer 0's K shape (the slots the kernel may address).
        self._kv: tuple[tuple[torch.Tensor, ...], tuple[int, ...], ctypes.Array, torch.Size] | None = None
        self._tables: _Tables | None = None  # the embedding and rope tables, as last checked
        #: None, or float64 [4] that each call adds its seconds to: the layers' projections, attention,
        #: the layers as a whole, and the head (see :meth:`time_parts`).
        self.timing: torch.Tensor | None = None

    @property
    def layers(self) -> tuple[DecodeLayer, ...]:
        """The layers, in order (a tuple: the stack's kernel array is built from them once)."""
        return self._layers

    @property
    def head(self) -> tuple[str, torch.Tensor, int] | None:
        """None, or the output projection ``(format, blocks, out_features)`` (the blocks a view this stack holds)."""
        return self._head

    @property
    def activation_dtype(self) -> str:
        """How the head rounds a step's activations (``"int16"``, ``"int8"``, or ``"bfloat16"``: int16's here)."""
        return self._activation_dtype

    def time_parts(self, on: bool = True) -> None:
        """Start (zeroed) or stop adding up where the calls spend their time (all layers together)."""
        self.timing = torch.zeros(4, dtype=torch.float64) if on else None

    def __deepcopy__(self, memo: dict) -> DecodeStack:
        import copy

        return DecodeStack([copy.deepcopy(layer, memo) for layer in self._layers], copy.deepcopy(self._norm, memo),
                           self._eps, copy.deepcopy(self._head, memo), embed_scale=self._embed_scale,
                           logit_softcap=self._logit_softcap, activation_dtype=self._activation_dtype)

    @property
    def rope_tables(self) -> int:
        """How many rope tables a call takes (one cos and one sin each): 1 + the largest layer's ``rope_table``."""
        return self._rope_tables

    @property
    def logit_softcap(self) -> float | None:
        """None, or the cap the logits are soft-capped at."""
        return self._logit_softcap

    @property
    def embed_scale(self) -> float:
        """What each embedding row is multiplied by before the first layer (1: as stored)."""
        return self._embed_scale

    def _cache_pointers(self, kv_caches: list) -> tuple[ctypes.Array, torch.Tensor]:
        """The caches' pointers and layer 0's K (whose shape bounds the slots and blocks the call may
        address), checked and gathered again whenever the list holds other tensors (compared by identity), a
        cache's data moved (``set_``, a reallocating ``resize_``) or layer 0's K changed shape (an in-place
        ``resize_`` of a view). Returned together, so that a call never pairs its pointers with the shape that
        another thread's call checked."""
        held = self._kv
        if not isinstance(kv_caches, (list, tuple)):
            raise TypeError(f"kv_caches must be a list of (k, v) pairs, got {type(kv_caches).__name__}")
        # The pairs and tensors it holds, read once (a list subclass's __len__ or __iter__ may say otherwise: the
        # kernel reads one K and one V pointer a layer from the array built of them).
        pairs = list(kv_caches)
        if len(pairs) != len(self._layers):
            raise ValueError(f"kv_caches: got {len(pairs)} kv caches for {len(self._layers)} layers")
        if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in pairs):
            raise TypeError("kv_caches must hold one (k, v) pair per layer")
        tensors = tuple(chain.from_iterable(pairs))
        if len(tensors) != 2 * len(pairs):
            raise TypeError("kv_caches must hold one (k, v) pair per layer")
        try:
            same = held is not None and all(map(operator.is_, tensors, held[0])) and (
                tuple(map(_data_ptr, held[0])) == held[1]) and held[0][0].shape == held[3]
        except (TypeError, IndexError, AttributeError, RuntimeError):
            same = False  # not tensors: refused below
        if same:
            return held[2], held[0][0]  # type: ignore[index]
        for i, t in enumerate(tensors):
            tensor(f"kv_caches[{i // 2}][{i % 2}]", t, torch.float32)
        shape = tensors[0].shape
        for layer, k, v in zip(self._layers, tensors[0::2], tensors[1::2]):
            kv_shape = (layer._kv_heads, layer._head_dim)
            if not (k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
                    and k.shape == v.shape == shape and k.dim() == 4 and tuple(k.shape[2:]) == kv_shape):
                raise TypeError(f"kv_caches: DecodeStack takes contiguous float32 K/V caches [blocks, block_size, "
                                f"{kv_shape[0]}, {kv_shape[1]}], all of one shape; got {k.dtype} "
                                f"{tuple(k.shape)} / {v.dtype} {tuple(v.shape)}")
        check_cache_size("kv_caches[0][0]", tensors[0])
        addresses = tuple(map(_data_ptr, tensors))
        held = self._kv = (tensors, addresses, (ctypes.c_void_p * len(tensors))(*addresses), tensors[0].shape)
        return held[2], tensors[0]

    def _check_tables(self, embed: torch.Tensor | BlockTable, cos_table: RopeTables, sin_table: RopeTables
                      ) -> _Tables:
        """The embedding and rope tables' pointers and sizes, and how the step's embedding rows are gathered (by
        the kernel, dequantized from a BlockTable or copied from a float32 table; here from any other float
        table); checked when they change."""
        held = self._tables
        is_blocks = isinstance(embed, BlockTable)
        memory_ = embed.blocks if is_blocks else embed  # type: ignore[union-attr]
        # the tables a tuple holds, read once (a subclass's __len__ may say otherwise: the kernel reads one pointer
        # a rope table)
        cos_t = tuple(cos_table) if isinstance(cos_table, tuple) else (cos_table,)
        sin_t = tuple(sin_table) if isinstance(sin_table, tuple) else (sin_table,)
        try:
            key = (memory_.data_ptr(), *map(_data_ptr, cos_t), *map(_data_ptr, sin_t))
            layout = (memory_.shape, memory_.dtype, memory_.stride(), embed.fmt if is_blocks else None,  # type: ignore[union-attr]
                      embed.regrouped if is_blocks else None,  # type: ignore[union-attr]
                      *((t.shape, t.dtype) for t in chain(cos_t, sin_t)))
        except (AttributeError, RuntimeError, TypeError):
            key = layout = None  # not tensors, or tensors without host memory: refused below
        if held is not None and held.addresses == key and held.embed_tensor is embed and len(cos_t) == len(
                held.cos_tensor) and all(map(operator.is_, cos_t, held.cos_tensor)) and all(
                map(operator.is_, sin_t, held.sin_tensor)) and held.layout == layout:
            return held
        layer = self._layers[0]
        half = layer._head_dim // 2
        kernel = embed_table(embed, layer._hidden, self._embed_scale)
        if kernel is None:  # a float table of another dtype or layout: its rows gathered here, then the call
            assert isinstance(embed, torch.Tensor)
            vocab, rows = embed.shape[0], _float_rows(embed, self._embed_scale)
        else:
            vocab, rows = kernel.vocab, None
        n = self._rope_tables
        for name, given in (("cos_table", cos_t), ("sin_table", sin_t)):
            if len(given) != n:
                raise TypeError(f"{name} must be {'a tensor' if n == 1 else f'a tuple of {n} tensors'}: the layers "
                                f"read {n} rope table{'s' if n > 1 else ''}, got {len(given)}")
        first = cos_t[0]
        for name, t in chain((("cos_table" if n == 1 else f"cos_table[{i}]", t) for i, t in enumerate(cos_t)),
                             (("sin_table" if n == 1 else f"sin_table[{i}]", t) for i, t in enumerate(sin_t))):
            tensor(name, t)
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != half or (
                    t.shape != first.shape):
                raise TypeError(f"{name} must be contiguous float32 [positions, {half}] like cos_table, got "
                                f"{t.dtype} {tuple(t.shape)}")
        assert key is not None
        held = self._tables = _Tables(key, (ctypes.c_void_p * n)(*key[1:1 + n]), (ctypes.c_void_p * n)(*key[1 + n:]),
                                      vocab, first.shape[0], kernel, rows, embed, cos_t, sin_t, layout)
        return held

    def __call__(self, input_ids: torch.Tensor, embed: torch.Tensor | BlockTable, positions: torch.Tensor,
                 cos_table: RopeTables, sin_table: RopeTables, kv_caches: list, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, *, logits: bool = False) -> torch.Tensor:
        """Run a step of decodes: int64 input_ids / positions / slots / context_lens [T]; ``embed`` the
        embedding table [vocab, hidden]: a :class:`BlockTable` in any block format, whose step rows the call
        dequantizes straight into the residual stream, or a float table (read by the call when it is float32 with
        contiguous rows; any other's rows gathered with torch first); each row times ``embed_scale``; cos/sin
        tables float32 [max_positions, head_dim / 2] (a tuple of :attr:`rope_tables` such tables each where the
        layers read more than one);
        ``kv_caches`` one (k, v) per layer; block_tables int64 [T, n]. Returns the final-normed hidden
        states, float32 [T, hidden], or with ``logits=True`` (needs a head) the logits [T, out_features].

        Raises TypeError naming the parameter for inputs not on the CPU, of another dtype or shape, or rows
        that disagree (one id, position, slot, context length and table row a token); ValueError for a
        step of no tokens, caches of no block or slot, sizes beyond 2**62; IndexError for a token id,
        position, context, slot or block outside its table."""
        tensor("input_ids", input_ids)
        num_tokens = input_ids.numel()
        for name, t in (("input_ids", input_ids), ("positions", positions), ("slots", slots),
                        ("context_lens", context_lens), ("block_tables", block_tables)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or not t.is_cpu or (
                    name != "block_tables" and (t.dim() != 1 or t.numel() != num_tokens or not t.is_contiguous())):
                tensor(name, t)
                raise TypeError(f"{name} must be a CPU int64 tensor, one entry a token (block_tables: one row), got "
                                f"{t.dtype} {tuple(t.shape)}")
            memory(name, t)
        if block_tables.dim() != 2 or block_tables.shape[0] != num_tokens:
            raise TypeError(f"block_tables must be int64 [{num_tokens}, blocks], got {tuple(block_tables.shape)}")
        if num_tokens < 1:
            raise ValueError(f"input_ids: a step of decodes has at least one token, got {num_tokens}")
        max_context = longest(context_lens)
        tables = block_tables if block_tables.is_contiguous() else contiguous(block_tables, "block_tables")
        return self._run(input_ids.shape[0], input_ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                         context_lens.data_ptr(), tables.data_ptr(), tables.shape[1], embed, cos_table, sin_table,
                         kv_caches, logits, lambda: input_ids, max_context)

    def decode_packed(self, packed: list[int], num_tokens: int, width: int, embed: torch.Tensor | BlockTable,
                      cos_table: RopeTables, sin_table: RopeTables, kv_caches: list
                      ) -> tuple[torch.Tensor, list[int]]:
        """The logits [T, out_features] of a step of decodes given as one list of ints (the T token ids,
        the T positions, the T cache slots, the T context lengths, then each sequence's block table
        padded to ``width``: the engine's decode path, one copy from Python and no tensor of its own),
        and each row's argmax (the greedy tokens, as :func:`argmax` picks them) from the same call.

        Raises ValueError for a stack without a head, ``num_tokens`` or ``width`` below 1, ``packed`` of
        another length or holding an int outside int64; TypeError for arguments of another type (``packed``
        a list of ints, ``num_tokens`` and ``width`` ints) and the tables and caches as :meth:`__call__`
        does; IndexError for a token id, position, context, slot or block outside its table."""
        if self._head is None:
            raise ValueError("decode_packed needs a DecodeStack built with a head")
        if type(num_tokens) is not int or type(width) is not int:  # a bool, float, numpy int...: named
            num_tokens, width = size("num_tokens", num_tokens, -2**63, 2**63), size("width", width, -2**63, 2**63)
        if num_tokens < 1 or width < 1:
            raise ValueError(f"num_tokens, width: a step of decodes has at least one token and one block, got "
                             f"{num_tokens} and {width}")
        try:
            data = array("q", packed)  # int64, range-checked
        except (TypeError, OverflowError, RuntimeError) as exc:  # RuntimeError: a tensor without a value
            raise (ValueError if isinstance(exc, OverflowError) else TypeError)(
                f"packed must be a list of ints within int64: {exc}") from None
        n = len(data)  # what was converted (a list subclass's own __len__ may say otherwise)
        if n != num_tokens * (4 + width):
            raise ValueError(f"packed holds {n} ints, not {num_tokens} * (4 + {width})")
        data.frombytes(bytes(8 * num_tokens))  # room for each row's argmax
        at = data.buffer_info()[0]
        logits = self._run(num_tokens, at, at + 8 * num_tokens, at + 16 * num_tokens, at + 24 * num_tokens,
                           at + 32 * num_tokens, width, embed, cos_table, sin_table, kv_caches, True,
                           lambda: torch.tensor(data[:num_tokens], dtype=torch.long),
                           max(data[3 * num_tokens:4 * num_tokens]), at + 8 * n)
        return logits, data[n:].tolist()

    def _run(self, num_tokens: int, ids: int, positions: int, slots: int, context_lens: int, tables: int, ldt: int,
             embed: torch.Tensor | BlockTable, cos_table: RopeTables, sin_table: RopeTables, kv_caches: list,
             logits: bool, input_ids: Callable[[], torch.Tensor], max_context: int,
             argmax: int | None = None) -> torch.Tensor:
        lib = _need()
        if logits and self._head is None:
            raise ValueError("logits=True needs a DecodeStack built with a head")
        if num_tokens * self._widest > _MAX_FLOATS:
            bounded("a step's working memory (tokens x the widest layer)", num_tokens, self._widest, 4)
        timing = self.timing
        _check_timing(timing, 4, "DecodeStack")
        h = None
        tables_in = self._check_tables(embed, cos_table, sin_table)
        if tables_in.rows is not None:  # a float table the kernel does not read: the step's rows gathered here
            try:
                h = contiguous(tables_in.rows(input_ids()), "embed")
            except IndexError:
                raise IndexError(f"input_ids: a token id is outside the embedding table [0, {tables_in.vocab})"
                                 ) from None
            ids = None  # type: ignore[assignment]
        if logits:  # the normed states stay inside the call
            _, blocks, head_n = self._head  # type: ignore[misc]
            out, head, result = None, (blocks.data_ptr(), self._head_code, head_n), torch.empty(num_tokens, head_n)
        else:
            out, head, result = torch.empty(num_tokens, self._layers[0]._hidden), (None, 0, 0), None
        pointers, cache = self._cache_pointers(kv_caches)  # cache: layer 0's K [blocks, block size, KV heads, D]
        if max_context > ldt * cache.shape[1]:  # before the kernels' own check, whose rounding-up could wrap
            check_width(ldt, cache.shape[1])
            check_context(max_context, ldt, cache.shape[1])
        args = (self._array, len(self._array), pointers, None if h is None else h.data_ptr(),
                num_tokens, ids, None if tables_in.kernel is None else tables_in.kernel.address, positions,
                tables_in.cos, tables_in.sin, self._rope_tables, tables_in.positions,
                self._norm.data_ptr(), self._eps, None if out is None else out.data_ptr(), *head, self._softcap,
                None if result is None else result.data_ptr(), argmax, slots, tables, ldt, context_lens,
                cache.shape[1], cache.shape[0] * cache.shape[1],  # block size, slots
                torch.get_num_threads(), None if timing is None else timing.data_ptr())
        if torch.autograd.profiler._is_profiler_enabled:  # one op per step in a trace
            with torch.profiler.record_function("asyncinfer::decode_stack"):
                code = lib.asyncinfer_decode_stack(*args)
        else:
            code = lib.asyncinfer_decode_stack(*args)
        if code == 1:
            raise IndexError(f"input_ids: a token id is outside the embedding table [0, {tables_in.vocab})")
        if code == 2:
            raise IndexError(f"positions: a position is outside the rope table [0, {tables_in.positions})")
        _raise_paged(code, ldt, cache)
        _check(code, "decode_stack")
        return out if result is None else result

