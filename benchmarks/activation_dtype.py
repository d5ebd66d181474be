"""The block formats' GEMMs with int16, int8 and bfloat16 activations (``activation_dtype``), at a model's real
shapes, beside the machine's read bandwidth.

One pass is one GEMM call per projection of ``--layers`` decoder layers (q, k, v, o, gate, up, down, each its
own random matrix in the format, as ``kernels.pack`` lays it out; enough layers that the weights do not stay in
cache), at M activation rows (a decode step of M tokens). The two activation dtypes are timed pass by pass,
interleaved, and the best of ``--repeats`` kept, so a machine others load still gives a fair ratio. Printed per
format and M: GB/s of weight bytes read with each, the ratio, and each rate as a share of the read probe (the
best of five sums of a 1 GiB float32 buffer on the same threads).

    python benchmarks/activation_dtype.py --shape 1b --threads 2 --json benchmarks/results/activation_dtype.json
    python benchmarks/activation_dtype.py --shape 1b --threads 1 --clock cpu --tokens 16 32 64   # a loaded machine
    python benchmarks/activation_dtype.py --shape tiny --repeats 2 --tokens 1     # a smoke run

From ``PANEL_MIN_ROWS`` (9) rows on, int16 is the int16 tile (AVX-512 variants) or the float32 panel (avx2, scalar:
``kernels.int16_batched()``) and int8 the int8 rows in passes. Beside them, int8's
tile (``kernels.gemm``'s ``int8_kernel="tile"``, the decoder layers' GEMM in prefills and mixed steps; the rows where
the build has no tile): the tokens 16-128 compare the paths of a prefill or a batched decode. And bfloat16
(``kernels.gemm``'s ``activation_dtype="bfloat16"``, called through ``kernels.gemm``: from ``BF16_MIN_ROWS`` rows on
the weights rebuilt as bfloat16 a slice at a time and multiplied by torch in bfloat16; int16's rows below it):
fast where the CPU has AMX or AVX-512 BF16, emulated elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info
from kquant_rows import SHAPES, layer_matrices
from peer import commit, read_bandwidth

from asyncinfer import kernels
from asyncinfer.kernels import _build
from asyncinfer.kernels.formats import LAYOUTS

FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--layers", type=int, default=2, help="layers of distinct weights per pass (default 2)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    ap.add_argument("--probe-mib", type=int, default=1024)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or the calling thread's CPU time (with --threads 1: others' load does not count)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread: it needs --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    lib = _build.lib()
    probe = read_bandwidth(args.probe_mib, 5)
    print(f"kernels: {kernels.isa()}; {args.threads} threads; read probe {probe:.1f} GB/s; shape {args.shape}, "
          f"{args.layers} layers a pass")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in args.formats:
        mats = []
        for _ in range(args.layers):
            for n, k in layer_matrices(args.shape):
                w = torch.randn(n, k, generator=gen) * 0.02
                mats.append((kernels.pack(kernels.quantize(w, fmt), fmt), n, k))
        nbytes = sum(p.numel() for p, _, _ in mats)
        for m in args.tokens:
            widths = {k for _, _, k in mats}
            xs = {k: torch.randn(m, k, generator=gen) for k in widths}
            scratch = {k: torch.empty(lib.asyncinfer_scratch_bytes(m, k), dtype=torch.uint8) for k in widths}
            ys = {n: torch.empty(m, n) for _, n, _ in mats}
            codes = {dtype: LAYOUTS[fmt].code | kernels.activation_dtype_flag(dtype) for dtype in ("int16", "int8")}
            codes["int8_tile"] = codes["int8"] | kernels.int8_kernel_flag("tile")
            codes["bfloat16"] = None  # through kernels.gemm (its product is torch's)
            best = {dtype: float("inf") for dtype in codes}
            for _ in range(args.repeats):
                for dtype, code in codes.items():
                    start = clock()
                    for packed, n, k in mats:
                        if code is None:
                            kernels.gemm(xs[k], packed, fmt, n, activation_dtype=dtype)
                        else:
                            lib.asyncinfer_gemm(code, xs[k].data_ptr(), m, k, k, packed.data_ptr(), n, None,
                                                ys[n].data_ptr(), n, args.threads, scratch[k].data_ptr())
                    best[dtype] = min(best[dtype], clock() - start)
            rate = {dtype: nbytes / t / 1e9 for dtype, t in best.items()}
            row = {"format": fmt, "tokens": m, "weight_bytes": nbytes,
                   "int16_gb_s": round(rate["int16"], 2), "int8_gb_s": round(rate["int8"], 2),
                   "int8_over_int16": round(best["int16"] / best["int8"], 3),
                   "int16_of_probe": round(rate["int16"] / probe, 3), "int8_of_probe": round(rate["int8"] / probe, 3),
                   "int8_tile_gb_s": round(rate["int8_tile"], 2),
                   "int8_tile_over_int8": round(best["int8"] / best["int8_tile"], 3),
                   "int8_tile_over_int16": round(best["int16"] / best["int8_tile"], 3),
                   "bf16_gb_s": round(rate["bfloat16"], 2),
                   "bf16_over_int16": round(best["int16"] / best["bfloat16"], 3),
                   "bf16_over_int8_tile": round(best["int8_tile"] / best["bfloat16"], 3),
                   "load_average_1min": round(os.getloadavg()[0], 2)}
            rows.append(row)
            print(f"{fmt:>5} M={m}: int16 {rate['int16']:5.1f} GB/s ({row['int16_of_probe']:.0%} of the probe), int8 "
                  f"rows {rate['int8']:5.1f} GB/s ({row['int8_of_probe']:.0%}): {row['int8_over_int16']:.2f}x; int8 "
                  f"tile {rate['int8_tile']:5.1f} GB/s: {row['int8_tile_over_int16']:.2f}x int16, "
                  f"{row['int8_tile_over_int8']:.2f}x the rows; bfloat16 {rate['bfloat16']:5.1f} GB/s: "
                  f"{row['bf16_over_int16']:.2f}x int16, {row['bf16_over_int8_tile']:.2f}x the int8 tile (load average "
                  f"{row['load_average_1min']})", flush=True)
    if args.json:
        record = {"command": "python benchmarks/activation_dtype.py " + " ".join(sys.argv[1:]),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit(), "kernels": kernels.isa(), "threads": args.threads, "clock": args.clock,
                  "read_probe_gb_s": probe, "bf16_min_rows": kernels.BF16_MIN_ROWS,
                  "machine": machine_info(), "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
