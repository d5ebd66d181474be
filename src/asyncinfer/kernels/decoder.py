"""The decoder in one kernel call: :class:`DecodeLayer` (one Llama-family layer for a step of decodes) and
:class:`DecodeStack` (every layer, the final norm and the head)."""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from itertools import chain
from typing import NamedTuple

import torch

from asyncinfer.kernels._build import lib as _need
from asyncinfer.kernels.formats import check_blocks as _check_blocks
from asyncinfer.kernels.ops import _check, _check_paged, _check_timing, _raise_paged

_FORMAT_CODES = {"q4_1": 0, "q8_0": 1}


class _Layer(ctypes.Structure):
    """``layer_t`` in gguf_gemm.c: one layer's weights (raw pointers) and shape."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("w_qkv", ctypes.c_void_p),
                ("b_qkv", ctypes.c_void_p), ("w_o", ctypes.c_void_p), ("w_gate_up", ctypes.c_void_p),
                ("w_down", ctypes.c_void_p), ("fmt_qkv", ctypes.c_int32), ("fmt_o", ctypes.c_int32),
                ("fmt_gate_up", ctypes.c_int32), ("fmt_down", ctypes.c_int32), ("hidden", ctypes.c_int64),
                ("H", ctypes.c_int64), ("KVH", ctypes.c_int64), ("D", ctypes.c_int64), ("I", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]



class DecodeLayer:
    """One Llama-family decoder layer for a step of decodes, in a single kernel call
    (``asyncinfer_decode_layer``): norms, projections, rope, the K/V write, attention over the paged
    cache and SwiGLU, each the same computation as the engine's kernels run op by op.

    Built once per layer from its weights (held here, so they outlive nothing); called per step with
    the residual stream ``h`` [T, hidden] (float32, contiguous, updated in place and returned).
    ``qkv``, ``o``, ``gate_up``, ``down``: each ``(format, blocks, bias or None)``, blocks as
    :func:`gemm` takes them (``pack(quantize(w, format), format)``; ``qkv`` the q, k and v rows one
    after another, ``gate_up`` the gate rows then the up rows); norms float32 [hidden].
    """

    def __init__(self, *, norm1: torch.Tensor, norm2: torch.Tensor, eps: float, qkv: tuple, o: tuple,
                 gate_up: tuple, down: tuple, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, scale: float) -> None:
        # qkv / o / gate_up / down: (format, blocks, bias or None).
        self._args = {"norm1": norm1, "norm2": norm2, "eps": eps, "qkv": qkv, "o": o, "gate_up": gate_up,
                      "down": down, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                      "intermediate_size": intermediate_size, "scale": scale}
        self._hidden = norm1.shape[0]
        self._struct = _Layer(
            norm1.data_ptr(), norm2.data_ptr(), qkv[1].data_ptr(), None if qkv[2] is None else qkv[2].data_ptr(),
            o[1].data_ptr(), gate_up[1].data_ptr(), down[1].data_ptr(), _FORMAT_CODES[qkv[0]], _FORMAT_CODES[o[0]],
            _FORMAT_CODES[gate_up[0]], _FORMAT_CODES[down[0]], self._hidden, num_heads, num_kv_heads, head_dim,
            intermediate_size, eps, scale)
        #: None, or float64 [3] that each call adds its seconds to: projections, attention, the whole
        #: layer (set by a profiler, e.g. ``benchmarks/throughput.py --profile``; see :meth:`time_parts`).
        self.timing: torch.Tensor | None = None

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

        Raises TypeError / ValueError for tensors of the wrong type or shape, IndexError for a context,
        slot or block outside the caches."""
        lib = _need()
        num_tokens = h.shape[0] if h.dim() == 2 else -1
        half = self._args["head_dim"] // 2
        kv_shape = (self._args["num_kv_heads"], self._args["head_dim"])
        if h.dtype != torch.float32 or h.dim() != 2 or h.shape[1] != self._hidden:
            raise ValueError(f"h must be float32 [T, {self._hidden}], got {h.dtype} {tuple(h.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != num_tokens * half:
                raise ValueError(f"{name} must be contiguous float32 [{num_tokens}, {half}], got {t.dtype} "
                                 f"{tuple(t.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 4 or tuple(t.shape[2:]) != kv_shape \
                    or t.shape != k_cache.shape:
                raise ValueError(f"{name} must be contiguous float32 [blocks, block_size, {kv_shape[0]}, "
                                 f"{kv_shape[1]}] like k_cache, got {t.dtype} {tuple(t.shape)}")
        _check_timing(self.timing, 3, "DecodeLayer")
        if not h.is_contiguous():
            h = h.contiguous()
        tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
        _check_paged(lib, tables, context_lens, slots, k_cache)
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


class _Tables(NamedTuple):
    """A DecodeStack's embedding and rope tables, as last checked: pointers, sizes, whether the kernel
    reads the embedding rows itself (float32, contiguous), and the tensors (their identity)."""

    embed: int
    cos: int
    sin: int
    vocab: int
    positions: int
    kernel_embeds: bool
    embed_tensor: torch.Tensor
    cos_tensor: torch.Tensor


class DecodeStack:
    """Every decoder layer of a model and its final norm, for a step of decodes, in one kernel call
    (``asyncinfer_decode_stack``): the embedding rows, the rope rows for each position, each layer as
    :class:`DecodeLayer` runs it, the final RMS norm and, with a ``head``, the logits. One call per
    step instead of one per layer, and none of torch's per-op cost between them.

    ``layers``: the model's DecodeLayers in order (kept here, with the weights they point to);
    ``final_norm`` / ``eps``: the model's last norm; ``head``: None, or the output projection as
    ``(format, blocks, out_features)`` (blocks as :func:`gemm` takes them).
    """

    def __init__(self, layers: list[DecodeLayer], final_norm: torch.Tensor, eps: float,
                 head: tuple[str, torch.Tensor, int] | None = None) -> None:
        if not layers:
            raise ValueError("DecodeStack needs at least one layer")
        if head is not None:
            fmt, blocks, out_features = head
            _check_blocks(blocks, fmt, out_features, layers[0]._hidden)
        self.layers = list(layers)
        self.head = head
        self._norm = final_norm.detach().float().contiguous()
        self._eps = eps
        self._array = (_Layer * len(self.layers))(*(layer._struct for layer in self.layers))
        # The caches as last checked: their tensors (k0, v0, k1, ...), layer 0's K address, their pointers.
        self._kv: tuple[tuple[torch.Tensor, ...], int, ctypes.Array] | None = None
        self._tables: _Tables | None = None  # the embedding and rope tables, as last checked
        #: None, or float64 [4] that each call adds its seconds to: the layers' projections, attention,
        #: the layers as a whole, and the head (see :meth:`time_parts`).
        self.timing: torch.Tensor | None = None

    def time_parts(self, on: bool = True) -> None:
        """Start (zeroed) or stop adding up where the calls spend their time (all layers together)."""
        self.timing = torch.zeros(4, dtype=torch.float64) if on else None

    def __deepcopy__(self, memo: dict) -> DecodeStack:
        import copy

        return DecodeStack([copy.deepcopy(layer, memo) for layer in self.layers], copy.deepcopy(self._norm, memo),
                           self._eps, copy.deepcopy(self.head, memo))

    def _cache_pointers(self, kv_caches: list) -> ctypes.Array:
        """The caches' pointers, checked and gathered again whenever the list holds other tensors (compared
        by identity, which costs no torch call) or layer 0's cache moved."""
        held = self._kv
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} kv caches for {len(self.layers)} layers")
        first = kv_caches[0][0].data_ptr()
        if held is None or held[1] != first or not all(map(operator.is_, chain.from_iterable(kv_caches), held[0])):
            tensors = tuple(chain.from_iterable(kv_caches))
            shape = tensors[0].shape
            for layer, (k, v) in zip(self.layers, kv_caches):
                kv_shape = (layer._args["num_kv_heads"], layer._args["head_dim"])
                if not (k.dtype == v.dtype == torch.float32 and k.is_contiguous() and v.is_contiguous()
                        and k.shape == v.shape == shape and k.dim() == 4 and tuple(k.shape[2:]) == kv_shape):
                    raise TypeError(f"DecodeStack takes contiguous float32 K/V caches [blocks, block_size, "
                                    f"{kv_shape[0]}, {kv_shape[1]}], all of one shape; got {k.dtype} "
                                    f"{tuple(k.shape)} / {v.dtype} {tuple(v.shape)}")
            pointers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
            held = self._kv = (tensors, first, pointers)
        return held[2]

    def _check_tables(self, embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> _Tables:
        """The embedding and rope tables' pointers and sizes, and whether the kernel embeds (float32
        rows); checked when they change."""
        key = (embed.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr())
        held = self._tables
        if held is not None and (held.embed, held.cos, held.sin) == key and held.embed_tensor is embed and (
                held.cos_tensor is cos_table):
            return held
        layer = self.layers[0]
        half = layer._args["head_dim"] // 2
        if embed.dim() != 2 or embed.shape[1] != layer._hidden or embed.device.type != "cpu":
            raise TypeError(f"embed must be a CPU table [vocab, {layer._hidden}], got {tuple(embed.shape)}")
        for name, t in (("cos_table", cos_table), ("sin_table", sin_table)):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape[1] != half or (
                    t.shape != cos_table.shape):
                raise TypeError(f"{name} must be contiguous float32 [positions, {half}] like cos_table, got "
                                f"{t.dtype} {tuple(t.shape)}")
        held = self._tables = _Tables(*key, embed.shape[0], cos_table.shape[0],
                                      embed.dtype == torch.float32 and embed.is_contiguous(), embed, cos_table)
        return held

    def __call__(self, input_ids: torch.Tensor, embed: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, kv_caches: list, slots: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, *, logits: bool = False) -> torch.Tensor:
        """Run a step of decodes: int64 input_ids / positions / slots / context_lens [T]; ``embed`` the
        embedding table [vocab, hidden]; cos/sin tables float32 [max_positions, head_dim / 2];
        ``kv_caches`` one (k, v) per layer; block_tables int64 [T, n]. Returns the final-normed hidden
        states, float32 [T, hidden], or with ``logits=True`` (needs a head) the logits [T, out_features].

        Raises TypeError for inputs of another dtype or shape, IndexError for a token id, position,
        context, slot or block outside its table."""
        num_tokens = input_ids.numel()
        for name, t in (("input_ids", input_ids), ("positions", positions), ("slots", slots),
                        ("context_lens", context_lens), ("block_tables", block_tables)):
            if t.dtype != torch.int64 or t.device.type != "cpu" or (
                    name != "block_tables" and (t.dim() != 1 or t.numel() != num_tokens or not t.is_contiguous())):
                raise TypeError(f"{name} must be a CPU int64 tensor, one entry a token (block_tables: one row), got "
                                f"{t.dtype} {tuple(t.shape)}")
        if block_tables.dim() != 2 or block_tables.shape[0] != num_tokens:
            raise TypeError(f"block_tables must be int64 [{num_tokens}, blocks], got {tuple(block_tables.shape)}")
        tables = block_tables if block_tables.is_contiguous() else block_tables.contiguous()
        return self._run(input_ids.shape[0], input_ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                         context_lens.data_ptr(), tables.data_ptr(), tables.shape[1], embed, cos_table, sin_table,
                         kv_caches, logits, lambda: input_ids)

    def decode_packed(self, packed: list[int], num_tokens: int, width: int, embed: torch.Tensor,
                      cos_table: torch.Tensor, sin_table: torch.Tensor, kv_caches: list
                      ) -> tuple[torch.Tensor, list[int]]:
        """The logits [T, out_features] of a step of decodes given as one list of ints (the T token ids,
        the T positions, the T cache slots, the T context lengths, then each sequence's block table
        padded to ``width``: the engine's decode path, one copy from Python and no tensor of its own),
        and each row's argmax (the greedy tokens, as :func:`argmax` picks them) from the same call."""
        if self.head is None:
            raise ValueError("decode_packed needs a DecodeStack built with a head")
        if num_tokens < 1 or width < 1:
            raise ValueError(f"a step of decodes has at least one token and one block, got {num_tokens} and {width}")
        if len(packed) != num_tokens * (4 + width):
            raise ValueError(f"packed holds {len(packed)} ints, not {num_tokens} * (4 + {width})")
        data = (ctypes.c_int64 * (len(packed) + num_tokens))(*packed)  # and room for each row's argmax
        at = ctypes.addressof(data)
        logits = self._run(num_tokens, at, at + 8 * num_tokens, at + 16 * num_tokens, at + 24 * num_tokens,
                           at + 32 * num_tokens, width, embed, cos_table, sin_table, kv_caches, True,
                           lambda: torch.tensor(packed[:num_tokens], dtype=torch.long), at + 8 * len(packed))
        return logits, data[len(packed):]

    def _run(self, num_tokens: int, ids: int, positions: int, slots: int, context_lens: int, tables: int, ldt: int,
             embed: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, kv_caches: list, logits: bool,
             input_ids: Callable[[], torch.Tensor], argmax: int | None = None) -> torch.Tensor:
        lib = _need()
        if logits and self.head is None:
            raise ValueError("logits=True needs a DecodeStack built with a head")
        if num_tokens < 1:
            raise ValueError(f"a step of decodes has at least one token, got {num_tokens}")
        timing = self.timing
        _check_timing(timing, 4, "DecodeStack")
        h = None
        tables_in = self._check_tables(embed, cos_table, sin_table)
        if not tables_in.kernel_embeds:  # embedded here instead
            h = torch.nn.functional.embedding(input_ids(), embed).float().contiguous()
            ids = None  # type: ignore[assignment]
        if logits:  # the normed states stay inside the call
            fmt, blocks, head_n = self.head  # type: ignore[misc]
            out, head, result = None, (blocks.data_ptr(), _FORMAT_CODES[fmt], head_n), torch.empty(num_tokens, head_n)
        else:
            out, head, result = torch.empty(num_tokens, self.layers[0]._hidden), (None, 0, 0), None
        pointers = self._cache_pointers(kv_caches)
        cache = self._kv[0][0]  # type: ignore[index]  # layer 0's K [blocks, block size, KV heads, head dim]
        args = (self._array, len(self.layers), pointers, None if h is None else h.data_ptr(),
                num_tokens, ids, tables_in.embed, tables_in.vocab, positions, tables_in.cos, tables_in.sin,
                tables_in.positions,
                self._norm.data_ptr(), self._eps, None if out is None else out.data_ptr(), *head,
                None if result is None else result.data_ptr(), argmax, slots, tables, ldt, context_lens,
                cache.shape[1], cache.shape[0] * cache.shape[1],  # block size, slots
                torch.get_num_threads(), None if timing is None else timing.data_ptr())
        if torch.autograd.profiler._is_profiler_enabled:  # one op per step in a trace
            with torch.profiler.record_function("asyncinfer::decode_stack"):
                code = lib.asyncinfer_decode_stack(*args)
        else:
            code = lib.asyncinfer_decode_stack(*args)
        if code == 1:
            raise IndexError(f"a token id is outside the embedding table [0, {tables_in.vocab})")
        if code == 2:
            raise IndexError(f"a position is outside the rope table [0, {tables_in.positions})")
        _raise_paged(code, ldt, cache)
        _check(code, "decode_stack")
        return out if result is None else result

