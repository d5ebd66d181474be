"""Speed of the block formats' row kernels per weight byte: the k-quants (Q4_K, Q5_K, Q6_K) against Q4_1 by
default, any block format with ``--formats``.

One GEMM call per projection of a decoder layer (q, k, v, o, gate, up, down, each its own matrix, random
weights quantized by ``kernels.quantize`` and held as ``kernels.pack`` lays them out), over ``--layers``
layers so the weights do not stay in cache, at M activation rows. Time is taken as the minimum of
``--repeats`` passes, the formats (and, with ``--baseline``, the two libraries, taking turns going first)
interleaved pass by pass, so a machine that others load still gives fair ratios. Printed per format and M:
milliseconds per pass, GB/s of weight bytes read, and that rate relative to Q4_1's in the same run (the target:
a k-quant row at least as fast per byte as a Q4_1 row).

The GEMMs are called through ctypes as ``kernels.gemm`` calls them. ``--baseline LIB`` times another build of the kernels' library (say, the installed
``_kernels_avx2.so`` of an earlier revision, which must take the same weight layout and GEMM signature) on
the same weights beside the one the package loads, and prints after / before per format and M. ``--json PATH``
records every pass's time (the commit, machine and command with them) and, per library, format and M, the minimum,
median and slowest pass; with a baseline, the per-pass ratio baseline time / now time (the two timed back to back
in each pass) as its median and spread.

    python benchmarks/kquant_rows.py --shape 1b --threads 1
    python benchmarks/kquant_rows.py --shape 1b --baseline /path/to/old/_kernels_avx2.so
    python benchmarks/kquant_rows.py --shape 1b --formats q4_0 q5_0 q5_1 --baseline OLD.so --json out.json
    python benchmarks/kquant_rows.py --shape 1b --activation-dtype int8 --baseline OLD.so   # the int8 rows
    python benchmarks/kquant_rows.py --shape 1b --clock cpu     # on a machine others load
    python benchmarks/kquant_rows.py --shape tiny --repeats 2     # a smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, write_record

from asyncinfer import kernels
from asyncinfer.kernels.formats import ACTIVATION_DTYPES, LAYOUTS, activation_dtype_flag

#: (hidden, intermediate, q heads * head dim, kv heads * head dim) per shape.
SHAPES = {
    "tiny": (256, 512, 256, 128),
    "1b": (2048, 8192, 2048, 512),  # Llama 3.2 1B-shaped: 32/8 heads of 64
    "3b": (3072, 8192, 3072, 1024),
}
FORMATS = ("q4_1", "q4_k", "q5_k", "q6_k")
#: What ``--formats`` takes: every block format.
CHOICES = tuple(kernels.BLOCK_FORMATS)


def layer_matrices(shape: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of one layer's projections."""
    hidden, inter, q, kv = SHAPES[shape]
    return [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]


class Weights:
    """One format's matrices: packed blocks, their shapes and bytes."""

    def __init__(self, fmt: str, shape: str, layers: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.fmt = fmt
        self.mats: list[tuple[torch.Tensor, int, int]] = []
        for _ in range(layers):
            for n, k in layer_matrices(shape):
                w = torch.randn(n, k, generator=gen) * 0.02
                self.mats.append((kernels.pack(kernels.quantize(w, fmt), fmt), n, k))
        self.nbytes = sum(p.numel() for p, _, _ in self.mats)


def typed_library(path: str | Path) -> ctypes.CDLL:
    """A kernels library (the loaded one's path, or another build's) with its GEMM entries and
    ``asyncinfer_scratch_bytes`` typed for ctypes."""
    lib = ctypes.CDLL(str(path))
    P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.asyncinfer_scratch_bytes.argtypes, lib.asyncinfer_scratch_bytes.restype = [I64, I64], I64
    for fmt in CHOICES:
        fn = getattr(lib, f"asyncinfer_gemm_{fmt}")
        fn.argtypes, fn.restype = [P, I64, I64, I64, P, I64, P, P, I64, INT, P], INT
    lib.asyncinfer_gemm.argtypes, lib.asyncinfer_gemm.restype = [INT, P, I64, I64, I64, P, I64, P, P, I64, INT, P], INT
    return lib


def library_pass(lib: ctypes.CDLL, threads: int, activation_dtype: str = "int16"
                 ) -> Callable[[Weights, dict[int, torch.Tensor]], None]:
    """A pass through a library's GEMM entries (``lib``: :func:`typed_library`'s), called as ``kernels.gemm``
    calls them (without its checks, whose cost would blur the smallest shapes): ``asyncinfer_gemm_<format>`` for
    int16 activations, and ``asyncinfer_gemm`` with the format's code and ``activation_dtype``'s flag for the
    others."""
    flag = activation_dtype_flag(activation_dtype)
    scratch: dict[tuple[int, int], torch.Tensor] = {}

    def run(weights: Weights, xs: dict[int, torch.Tensor]) -> None:
        fn = getattr(lib, f"asyncinfer_gemm_{weights.fmt}")
        code = LAYOUTS[weights.fmt].code | flag
        for packed, n, k in weights.mats:
            x = xs[k]
            m = x.shape[0]
            if (m, k) not in scratch:
                scratch[m, k] = torch.empty(lib.asyncinfer_scratch_bytes(m, k), dtype=torch.uint8)
            y = torch.empty(m, n)
            args = (x.data_ptr(), m, k, k, packed.data_ptr(), n, None, y.data_ptr(), n, threads,
                    scratch[m, k].data_ptr())
            if (lib.asyncinfer_gemm(code, *args) if flag else fn(*args)):
                raise RuntimeError(f"the {weights.fmt} GEMM failed")

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--layers", type=int, default=2, help="layers of distinct weights per pass (default 2)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=7, help="passes per format and M; the minimum is kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", nargs="+", choices=CHOICES, default=list(FORMATS))
    ap.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES, default="int16",
                    help="how the GEMMs round the activations (EngineConfig's activation_dtype; default int16)")
    ap.add_argument("--baseline", type=Path, default=None, help="another build of the kernels' library to compare")
    ap.add_argument("--json", type=Path, default=None, help="write every pass's time and the summaries here")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this thread's CPU time (one thread only: the GEMMs then run on the calling "
                         "thread; steadier where other processes take the cores)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread: it needs --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if not kernels.available():
        raise SystemExit(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    fmts = list(dict.fromkeys(["q4_1", *args.formats]))  # Q4_1: the per-byte yardstick
    weights = {fmt: Weights(fmt, args.shape, args.layers, seed=1) for fmt in fmts}
    now = typed_library(kernels.build_info()["path"])  # the library the package loaded
    runners = {"now": library_pass(now, args.threads, args.activation_dtype)}
    if args.baseline is not None:
        runners["baseline"] = library_pass(typed_library(args.baseline), args.threads, args.activation_dtype)
    widths = sorted({k for _, k in layer_matrices(args.shape)})
    best: dict[tuple[str, str, int], float] = {}
    passes: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        for m in args.tokens:
            gen = torch.Generator().manual_seed(m)
            xs = {k: torch.randn(m, k, generator=gen) for k in widths}
            for run in runners.values():  # warm-up
                for w in weights.values():
                    run(w, xs)
            for rep in range(args.repeats):
                for fmt, w in weights.items():
                    # the two libraries take turns going first: the second to read the same weights may find
                    # some of them still in a large last-level cache
                    order = list(runners.items())
                    for name, run in (order[::-1] if rep % 2 else order):
                        start = clock()
                        run(w, xs)
                        elapsed = clock() - start
                        key = (name, fmt, m)
                        best[key] = min(best.get(key, elapsed), elapsed)
                        passes.setdefault(key, []).append(elapsed)
    print(f"kernels {kernels.isa()}, shape {args.shape} x {args.layers} layers, {args.threads} thread(s), "
          f"min of {args.repeats} interleaved passes, {args.clock} time, {args.activation_dtype} activations")
    for name in runners:
        print(f"\n[{name}]  ms per pass / GB/s of weights / per byte vs q4_1")
        print(f"{'format':<8}{'MB':>8}" + "".join(f"{'M=' + str(m):>24}" for m in args.tokens))
        for fmt, w in weights.items():
            cells = []
            for m in args.tokens:
                t = best[name, fmt, m]
                rate = w.nbytes / t / 1e9
                ref = weights["q4_1"].nbytes / best[name, "q4_1", m] / 1e9
                cells.append(f"{t * 1e3:8.2f} {rate:6.2f} {rate / ref:6.2f}x")
            print(f"{fmt:<8}{w.nbytes / 1e6:8.1f}" + "".join(f"{c:>24}" for c in cells))
    if args.baseline is not None:
        print("\nspeed-up, now over baseline (baseline time / now time)")
        print(f"{'format':<8}" + "".join(f"{'M=' + str(m):>10}" for m in args.tokens))
        for fmt in weights:
            print(f"{fmt:<8}" + "".join(f"{best['baseline', fmt, m] / best['now', fmt, m]:10.2f}"
                                        for m in args.tokens))
    if args.json is not None:
        write_record(args.json, record(args, weights, runners, passes))


def record(args: argparse.Namespace, weights: dict[str, Weights], runners: dict[str, Callable[..., None]],
           passes: dict[tuple[str, str, int], list[float]]) -> dict[str, object]:
    """The JSON record: settings, machine, commit, and per library, format and M every pass's seconds with their
    minimum, median and maximum (and GB/s of weights at the median); with a baseline, per format and M the ratios
    baseline / now of each pass (timed back to back) and their median, minimum and maximum."""
    rows = []
    for (name, fmt, m), times in passes.items():
        median = statistics.median(times)
        rows.append({"library": name, "format": fmt, "tokens": m, "seconds": [round(t, 6) for t in times],
                     "min_s": min(times), "median_s": median, "max_s": max(times),
                     "median_gb_per_s": round(weights[fmt].nbytes / median / 1e9, 3)})
    speedups = []
    if "baseline" in runners:
        for fmt in weights:
            for m in args.tokens:
                ratios = [b / n for b, n in zip(passes["baseline", fmt, m], passes["now", fmt, m])]
                speedups.append({"format": fmt, "tokens": m, "ratios": [round(r, 4) for r in ratios],
                                 "median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                                 "max": round(max(ratios), 4)})
    return {
        "command": "python benchmarks/kquant_rows.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "load_average_after": os.getloadavg(),
        "kernel_isa": kernels.isa(), "library": kernels.build_info()["path"],
        "baseline": str(args.baseline) if args.baseline is not None else None,
        "shape": args.shape, "layers": args.layers, "threads": args.threads, "clock": args.clock,
        "activation_dtype": args.activation_dtype,
        "repeats": args.repeats, "weight_bytes": {fmt: w.nbytes for fmt, w in weights.items()},
        "what": "seconds of one pass of one GEMM call per projection over the layers, formats and libraries "
                "interleaved pass by pass; speed-up = baseline seconds / now seconds of the same pass",
        "passes": rows, "speedup_over_baseline": speedups,
    }


if __name__ == "__main__":
    main()
