"""Hypothesis drives every public kernel entry with hostile arguments: a valid call with one to three of its
arguments swapped for random tensors (any shape, dtype, the meta device, transposed, strided, expanded to
huge sizes), other objects, extreme ints, or the valid tensor moved, retyped, emptied or filled with extreme
ints. Each call must return, or raise TypeError / ValueError / IndexError (MemoryError for an allocation the
machine cannot make) whose message names one of the entry's parameters; anything else fails the run, and a
crash ends the process with its signal.

Run as a script (``tests/models/test_kernel_validation.py`` does, in a subprocess): exits 0 when every
example passed. ``KERNEL_FUZZ_EXAMPLES`` sets the number of examples; each example's description is written
to the file named by ``KERNEL_FUZZ_LOG`` before its call, so the last line names the call that crashed."""

from __future__ import annotations

import os
import re
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncinfer import kernels
from tests.models.kernel_cases import (
    GOOD_PACKED,
    HIDDEN,
    block_embed,
    blocks,
    layer_args,
    long,
    mixed_qkv,
    tables,
    tiny_stack,
)

ALLOWED = (TypeError, ValueError, IndexError, MemoryError)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)
SIZES = (0, 1, 2, 3, 8, 16, 32, 64)
HUGE = (2**40, 2**56, 2**61)
INTS = (-(2**63), -(2**31), -1, 0, 1, 7, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 + 1)
OTHERS = (None, "x", 1.5, float("nan"), True, [1, 2], (), object())

_LOG = open(os.environ["KERNEL_FUZZ_LOG"], "w") if os.environ.get("KERNEL_FUZZ_LOG") else None  # noqa: SIM115


def _random_tensor(draw) -> torch.Tensor:
    shape = [draw(st.sampled_from(SIZES)) for _ in range(draw(st.integers(0, 4)))]
    dtype = draw(st.sampled_from(DTYPES))
    t = (torch.randn(shape) * 3).to(dtype) if dtype != torch.bool else torch.zeros(shape, dtype=dtype)
    return _reshape(draw, t)


def _reshape(draw, t: torch.Tensor) -> torch.Tensor:
    how = draw(st.sampled_from(("as is", "meta", "transposed", "strided", "empty", "expanded", "dtype")))
    if how == "meta":
        return t.to("meta")
    if how == "dtype":
        return t.to(draw(st.sampled_from(DTYPES)))
    if how == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1)
    if how == "strided" and t.dim() >= 1:
        return t[::2]
    if how == "empty" and t.dim() >= 1:
        return t[:0]
    if how == "expanded" and t.dim() >= 1 and t.numel():
        axis = draw(st.integers(0, t.dim() - 1))
        one = t.narrow(axis, 0, 1)
        shape = list(one.shape)
        shape[axis] = draw(st.sampled_from(HUGE))
        numel = 1
        for s in shape:
            numel *= s
        if numel < 2**63:
            return one.expand(shape)
    return t


def _hostile(draw, valid: object) -> object:
    """Something in place of ``valid``: a mutation of it, a random tensor, an extreme int, another object."""
    kind = draw(st.sampled_from(("mutate", "mutate", "tensor", "int", "other")))
    if kind == "mutate" and isinstance(valid, torch.Tensor):
        if valid.dtype == torch.int64 and valid.numel() and draw(st.booleans()):
            bad = valid.clone()
            bad.view(-1)[draw(st.integers(0, bad.numel() - 1))] = draw(st.sampled_from(INTS[:9]))
            return bad
        return _reshape(draw, valid)
    if kind == "mutate" and isinstance(valid, tuple) and valid:  # a projection or head: one part swapped
        i = draw(st.integers(0, len(valid) - 1))
        return valid[:i] + (_hostile(draw, valid[i]),) + valid[i + 1:]
    if kind == "mutate" and isinstance(valid, list) and valid:  # caches or layers: one entry swapped
        out = list(valid)
        out[draw(st.integers(0, len(out) - 1))] = _hostile(draw, out[0])
        return out
    if kind in ("mutate", "tensor"):
        return _random_tensor(draw)
    if kind == "int":
        return draw(st.sampled_from(INTS))
    return draw(st.sampled_from(OTHERS))


_STACK = tiny_stack()
_LAYER = _STACK.layers[0]


def _entries() -> dict:
    """entry -> (its function, a valid call's keyword arguments)."""
    embed, cos, sin, caches = tables()
    w = blocks(8, 64)
    cache = torch.zeros(4, 16, 1, 16)
    q_blocks = kernels.quantize(torch.randn(8, 64), "q8_0")
    return {
        "gemm": (kernels.gemm, {"x": torch.randn(3, 64), "packed": w, "fmt": "q4_1", "out_features": 8,
                                "bias": torch.zeros(8)}),
        "gemm_panel": (kernels.gemm, {"x": torch.randn(6, 64), "packed": w, "fmt": "q4_1", "out_features": 8}),
        "rms_norm": (kernels.rms_norm, {"x": torch.randn(2, 8), "weight": torch.ones(8), "eps": 1e-5}),
        "decode_attention": (kernels.decode_attention, {
            "q": torch.randn(2, 2, 16), "k_cache": cache, "v_cache": cache.clone(),
            "block_tables": long(0, 1, 2, 3).view(2, 2), "context_lens": long(20, 3), "scale": 0.25}),
        "decode_attention capped, windowed": (kernels.decode_attention, {
            "q": torch.randn(2, 2, 16), "k_cache": cache, "v_cache": cache.clone(),
            "block_tables": long(0, 1, 2, 3).view(2, 2), "context_lens": long(20, 3), "scale": 0.25,
            "softcap": 30.0, "window": 4}),
        "argmax": (kernels.argmax, {"x": torch.randn(3, 10)}),
        "quantize": (kernels.quantize, {"weight": torch.randn(4, 64), "fmt": "q4_1"}),
        "dequantize": (kernels.dequantize, {"blocks": q_blocks, "fmt": "q8_0"}),
        "pack": (kernels.pack, {"blocks": q_blocks, "fmt": "q8_0"}),
        "unpack": (kernels.unpack, {"blocks": kernels.pack(q_blocks, "q8_0"), "fmt": "q8_0"}),
        "DecodeLayer": (kernels.DecodeLayer, layer_args()),
        "DecodeLayer of mixed formats": (kernels.DecodeLayer, {**layer_args(), "qkv": mixed_qkv()}),
        "gemm q4_k": (kernels.gemm, {"x": torch.randn(2, 512), "packed": blocks(8, 512, "q4_k"), "fmt": "q4_k",
                                     "out_features": 8, "bias": torch.zeros(8)}),
        "gemm q6_k panel": (kernels.gemm, {"x": torch.randn(6, 256), "packed": blocks(8, 256, "q6_k"), "fmt": "q6_k",
                                           "out_features": 8}),
        "gemm q5_0": (kernels.gemm, {"x": torch.randn(1, 64), "packed": blocks(8, 64, "q5_0"), "fmt": "q5_0",
                                     "out_features": 8}),
        "quantize q5_k": (kernels.quantize, {"weight": torch.randn(4, 256), "fmt": "q5_k"}),
        "dequantize q6_k": (kernels.dequantize, {"blocks": kernels.quantize(torch.randn(8, 256), "q6_k"),
                                                 "fmt": "q6_k"}),
        "DecodeLayer call": (_LAYER, {
            "h": torch.zeros(1, HIDDEN), "cos": cos[:1], "sin": sin[:1], "k_cache": caches[0][0],
            "v_cache": caches[0][1], "slots": long(5), "block_tables": long(0, 1).view(1, 2),
            "context_lens": long(6)}),
        "DecodeStack": (kernels.DecodeStack, {"layers": list(_STACK.layers), "final_norm": torch.ones(HIDDEN),
                                              "eps": 1e-5, "head": _STACK.head}),
        "DecodeStack call": (_STACK, {
            "input_ids": long(3), "embed": embed, "positions": long(5), "cos_table": cos, "sin_table": sin,
            "kv_caches": caches, "slots": long(5), "block_tables": long(0, 1).view(1, 2),
            "context_lens": long(6)}),
        "decode_packed": (_STACK.decode_packed, {"packed": list(GOOD_PACKED), "num_tokens": 1, "width": 2,
                                                 "embed": embed, "cos_table": cos, "sin_table": sin,
                                                 "kv_caches": caches}),
        "DecodeStack call, block embedding": (_STACK, {
            "input_ids": long(3), "embed": block_embed("q4_1"), "positions": long(5), "cos_table": cos,
            "sin_table": sin, "kv_caches": caches, "slots": long(5), "block_tables": long(0, 1).view(1, 2),
            "context_lens": long(6)}),
        "decode_packed, block embedding in the kernels' layout": (_STACK.decode_packed, {
            "packed": list(GOOD_PACKED), "num_tokens": 1, "width": 2, "embed": block_embed("q8_0", packed=True),
            "cos_table": cos, "sin_table": sin, "kv_caches": caches}),
        "DecodeStack with an embedding scale": (kernels.DecodeStack, {
            "layers": list(_STACK.layers), "final_norm": torch.ones(HIDDEN), "eps": 1e-5, "head": _STACK.head,
            "embed_scale": 5.65625}),
        "embed_rows": (kernels.embed_rows, {"table": block_embed("q5_1"), "ids": long(3, 0, 39), "scale": 2.0}),
        "embed_rows q6_k": (kernels.embed_rows, {"table": kernels.BlockTable(blocks(8, 256, "q6_k"), "q6_k"),
                                                 "ids": long(7, 1)}),
        "embed_rows float32": (kernels.embed_rows, {"table": embed, "ids": long(2)}),
    }


ENTRIES = _entries()
#: Words a message may name besides the keyword arguments (the parts of a shape, the list's entries).
ALIASES = ("heads", "KV heads", "head_dim", "layers", "kv_caches", "timing", "hidden", "out_features",
           "blocks", "bias", "weights", "input_ids", "context_lens", "positions", "slots", "block_tables")


@st.composite
def calls(draw):
    entry = draw(st.sampled_from(sorted(ENTRIES)))
    fn, valid = ENTRIES[entry]
    args = dict(valid)
    for name in draw(st.lists(st.sampled_from(sorted(valid)), min_size=1, max_size=3, unique=True)):
        if name == "packed" and draw(st.booleans()):  # decode_packed's list: one int made extreme
            packed = list(args["packed"])
            packed[draw(st.integers(0, len(packed) - 1))] = draw(st.sampled_from(INTS))
            args[name] = packed
        else:
            args[name] = _hostile(draw, valid[name])
    return entry, fn, args


def _describe(entry: str, args: dict) -> str:
    def one(v: object) -> str:
        if isinstance(v, torch.Tensor):
            return f"Tensor({v.dtype}, {tuple(v.shape)}, stride {v.stride() if v.layout == torch.strided else '-'}, " \
                   f"{v.device})"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(map(one, v)) + "]" if len(v) < 12 else f"<{len(v)} items>"
        return repr(v)[:60]

    return f"{entry}(" + ", ".join(f"{k}={one(v)}" for k, v in args.items()) + ")"


@settings(max_examples=int(os.environ.get("KERNEL_FUZZ_EXAMPLES", "400")), deadline=None, database=None,
          derandomize=bool(os.environ.get("KERNEL_FUZZ_DERANDOMIZE")),
          suppress_health_check=list(HealthCheck))
@given(calls())
def test_hostile_calls(call) -> None:
    entry, fn, args = call
    if _LOG:
        _LOG.write(_describe(entry, args) + "\n")
        _LOG.flush()
    try:
        fn(**args)
    except ALLOWED as exc:
        names = (*args, *ALIASES)
        message = str(exc)
        assert any(re.search(rf"(^|[^A-Za-z_]){re.escape(n)}([^A-Za-z_]|$)", message) for n in names), (
            f"{_describe(entry, args)}: {type(exc).__name__}({message!r}) names no parameter")


if __name__ == "__main__":
    assert kernels.available(), kernels.unavailable_reason()
    torch.set_num_threads(1)
    test_hostile_calls()
    print("no crash, only typed errors naming their parameter")
    sys.exit(0)
