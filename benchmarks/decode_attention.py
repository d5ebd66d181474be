"""Decode attention on the kernels (one query token per sequence over a paged float32 cache, the kernels'
``asyncinfer_decode_attention``) as a decode step meets it: each call's keys and values out of the caches,
a layer's weights having streamed through them just before.

Per context length of ``--contexts``: ``--layers`` caches of their own (the 1B Llama shape by default: 32
query heads, 8 KV heads of 64, blocks of 16 slots, the blocks of a sequence scattered at random through
the cache, as a running engine's are), and before each layer's attention call a Q4_K GEMM of one row over
``--evict-mib`` MiB of weights on the same threads (what a step's projections do to the caches); only the
attention calls are timed. A pass is one call per layer; ``--repeats`` passes. ``--baseline LIB`` times
another build of the kernels' library on the same caches, the two libraries taking turns going first pass by
pass, and prints the median of the per-pass ratios baseline time / now time (the two back to back), with
whether their outputs are bit-identical.

    python benchmarks/decode_attention.py --threads 2 --baseline OLD.so --json out.json
    python benchmarks/decode_attention.py --contexts 16 --layers 2 --repeats 2 --evict-mib 2   # smoke test
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, write_record
from kquant_rows import typed_library

from asyncinfer import kernels
from asyncinfer.kernels.formats import LAYOUTS, activation_dtype_flag


def attention_library(path: str | Path) -> ctypes.CDLL:
    """:func:`kquant_rows.typed_library` with ``asyncinfer_decode_attention`` typed too."""
    lib = typed_library(path)
    P, I64, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.asyncinfer_decode_attention.argtypes = [P, P, P, P, I64, P, I64, I64, I64, I64, I64, F, F, I64, P,
                                                ctypes.c_int]
    lib.asyncinfer_decode_attention.restype = ctypes.c_int
    return lib


class Layer:
    """One layer's paged caches at a context length, its block table and query."""

    def __init__(self, context: int, args: argparse.Namespace, gen: torch.Generator) -> None:
        blocks = -(-context // args.block_size)
        total = 2 * blocks  # half the cache's blocks belong to other sequences
        shape = (total, args.block_size, args.kv_heads, args.head_dim)
        self.k = torch.randn(shape, generator=gen)
        self.v = torch.randn(shape, generator=gen)
        self.table = torch.randperm(total, generator=gen)[:blocks].to(torch.int64).reshape(1, blocks)
        self.ctx = torch.tensor([context], dtype=torch.int64)
        self.q = torch.randn(1, args.heads, args.head_dim, generator=gen)


class Evict(NamedTuple):
    """The GEMM run before each attention call: one activation row x against the Q4_K rows of weights into y."""

    code: int
    x: torch.Tensor
    weights: torch.Tensor
    y: torch.Tensor


def one_pass(lib: ctypes.CDLL, layers: list[Layer], out: torch.Tensor, scratch: torch.Tensor, evict: Evict,
             args: argparse.Namespace) -> float:
    """One attention call per layer, each after the evicting GEMM: the calls' mean seconds (the GEMMs untimed)."""
    total, k_in, rows = 0.0, evict.x.shape[1], evict.y.shape[1]
    for i, layer in enumerate(layers):
        if lib.asyncinfer_gemm(evict.code, evict.x.data_ptr(), 1, k_in, k_in, evict.weights.data_ptr(), rows, None,
                               evict.y.data_ptr(), rows, args.threads, scratch.data_ptr()):
            raise RuntimeError("the GEMM failed")
        start = time.perf_counter()
        rc = lib.asyncinfer_decode_attention(
            layer.q.data_ptr(), layer.k.data_ptr(), layer.v.data_ptr(), layer.table.data_ptr(), layer.table.shape[1],
            layer.ctx.data_ptr(), 1, args.heads, args.kv_heads, args.head_dim, args.block_size,
            args.head_dim ** -0.5, 0.0, 0, out[i].data_ptr(), args.threads)
        total += time.perf_counter() - start
        if rc:
            raise RuntimeError(f"decode attention failed ({rc})")
    return total / len(layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--evict-mib", type=int, default=36, help="MiB of Q4_K weights a GEMM reads before each call")
    ap.add_argument("--baseline", type=Path, default=None, help="another build of the kernels' library to compare")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for name in ("layers", "heads", "kv_heads", "head_dim", "block_size", "threads", "repeats", "evict_mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.contexts) < 1 or args.heads % args.kv_heads or args.head_dim % 8:
        ap.error("contexts must be at least 1, --heads a multiple of --kv-heads and --head-dim of 8")
    if not kernels.available():
        raise SystemExit(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    libs = {"now": attention_library(kernels.build_info()["path"])}
    if args.baseline is not None:
        libs["baseline"] = attention_library(args.baseline)
    k_in = 2048
    rows = max(1, args.evict_mib * 2**20 // (k_in // 256 * LAYOUTS["q4_k"].nbytes))
    weights = torch.randint(0, 256, (rows, k_in // 256 * LAYOUTS["q4_k"].nbytes), dtype=torch.uint8)
    weights.view(-1, LAYOUTS["q4_k"].nbytes)[:, :4] = torch.tensor([0, 20, 0, 20], dtype=torch.uint8)  # small d, dmin
    x, y = torch.randn(1, k_in), torch.empty(1, rows)
    evict = Evict(LAYOUTS["q4_k"].code | activation_dtype_flag("int8"), x, weights, y)
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        for context in args.contexts:
            gen = torch.Generator().manual_seed(context)
            layers = [Layer(context, args, gen) for _ in range(args.layers)]
            outs = {name: torch.empty(args.layers, 1, args.heads, args.head_dim) for name in libs}
            scratch = {name: torch.empty(lib.asyncinfer_scratch_bytes(1, k_in), dtype=torch.uint8)
                       for name, lib in libs.items()}

            for name, lib in libs.items():  # warm-up
                one_pass(lib, layers, outs[name], scratch[name], evict, args)
            times: dict[str, list[float]] = {name: [] for name in libs}
            for rep in range(args.repeats):
                order = list(libs) if rep % 2 == 0 else list(libs)[::-1]
                for name in order:
                    times[name].append(one_pass(libs[name], layers, outs[name], scratch[name], evict, args))
            row: dict[str, Any] = {"context": context,
                                   "kv_bytes_per_call": 2 * context * args.kv_heads * args.head_dim * 4}
            for name, ts in times.items():
                row[name] = {"us_per_call": [round(t * 1e6, 2) for t in ts],
                             "median_us": round(statistics.median(ts) * 1e6, 2), "min_us": round(min(ts) * 1e6, 2)}
            line = f"context {context:6d}: now {row['now']['median_us']:8.1f} us"
            if "baseline" in libs:
                ratios = [b / n for b, n in zip(times["baseline"], times["now"])]
                row["speedup"] = {"ratios": [round(r, 4) for r in ratios], "median": round(statistics.median(ratios), 4),
                                  "min": round(min(ratios), 4), "max": round(max(ratios), 4)}
                row["outputs_identical"] = bool(torch.equal(outs["now"], outs["baseline"]))
                line += (f", baseline {row['baseline']['median_us']:8.1f} us, speed-up {row['speedup']['median']:.3f}x "
                         f"({row['speedup']['min']:.3f}-{row['speedup']['max']:.3f}), outputs "
                         f"{'identical' if row['outputs_identical'] else 'DIFFER'}")
            print(line + " (median per call)", flush=True)
            results.append(row)
    if args.json is not None:
        write_record(args.json, {
            "command": "python benchmarks/decode_attention.py " + " ".join(sys.argv[1:]),
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "load_average_after": os.getloadavg(), "kernel_isa": kernels.isa(),
            "library": kernels.build_info()["path"],
            "baseline": str(args.baseline) if args.baseline is not None else None,
            "settings": {name: getattr(args, name) for name in ("contexts", "layers", "heads", "kv_heads", "head_dim",
                                                                "block_size", "threads", "repeats", "evict_mib")},
            "what": "microseconds per decode-attention call (one sequence), each after a GEMM over evict_mib MiB of "
                    "weights; per pass the mean over the layers; speed-up = baseline / now of the same pass",
            "rows": results,
        })


if __name__ == "__main__":
    main()
