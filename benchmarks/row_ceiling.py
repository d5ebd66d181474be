"""One core's rate of the block formats' row kernels with the weights in cache: the ceiling their instructions set
on a decode step, apart from what the memory delivers.

One matrix of ``--rows`` x ``--width`` random weights per format (``kernels.quantize``, laid out by
``kernels.pack``: about 300 KB in Q4_0 at the default 256 x 2048, within a core's L2 cache), multiplied by M
activation rows on one thread, ``--calls`` times in a timed block; each library and format takes its turn in every
one of ``--repeats`` rounds, and the fastest block of each is kept. Printed per format and M: GB/s of weights read
per second of that block, and with ``--baseline`` the after / before ratio. A row kernel that reads far faster here
than the machine's memory delivers to a core is bound by the memory in a real step; one that reads near or below it
is bound by its own instructions (``kquant_rows`` times the same kernels on weights that do not stay in cache).

    python benchmarks/row_ceiling.py --formats q4_0 q4_1 q8_0 q4_k q6_k
    python benchmarks/row_ceiling.py --activation-dtype int8 --baseline OLD.so --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, write_record
from kquant_rows import typed_library

from asyncinfer import kernels
from asyncinfer.kernels.formats import ACTIVATION_DTYPES, LAYOUTS, activation_dtype_flag


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", choices=tuple(kernels.BLOCK_FORMATS), default=["q4_0", "q4_1", "q8_0",
                                                                                           "q4_k", "q6_k"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="activation rows M of each call")
    ap.add_argument("--rows", type=int, default=256, help="weight rows of the matrix (default 256)")
    ap.add_argument("--width", type=int, default=2048, help="its width, a multiple of 256 (default 2048)")
    ap.add_argument("--calls", type=int, default=1000, help="calls in a timed block (default 1000)")
    ap.add_argument("--repeats", type=int, default=15, help="rounds; the fastest block is kept (default 15)")
    ap.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES[:2], default="int16")
    ap.add_argument("--baseline", type=Path, default=None, help="another build of the kernels' library to compare")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.width <= 0 or args.width % 256 or args.rows <= 0 or args.calls <= 0 or args.repeats <= 0:
        ap.error("--width must be a positive multiple of 256; --rows, --calls and --repeats positive")
    if not kernels.available():
        raise SystemExit(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    torch.set_num_threads(1)
    libs = {"now": typed_library(kernels.build_info()["path"])}
    if args.baseline is not None:
        libs["baseline"] = typed_library(args.baseline)
    flag = activation_dtype_flag(args.activation_dtype)
    gen = torch.Generator().manual_seed(0)
    weights = {f: kernels.pack(kernels.quantize(torch.randn(args.rows, args.width, generator=gen) * 0.02, f), f)
               for f in args.formats}
    best: dict[tuple[str, str, int], float] = {}
    keep: list[torch.Tensor] = []
    for m in args.tokens:
        x, y = torch.randn(m, args.width, generator=gen), torch.empty(m, args.rows)
        calls = {}
        for name, lib in libs.items():
            scratch = torch.empty(lib.asyncinfer_scratch_bytes(m, args.width), dtype=torch.uint8)
            keep.append(scratch)
            for f, w in weights.items():
                calls[name, f] = (lib.asyncinfer_gemm, (LAYOUTS[f].code | flag, x.data_ptr(), m, args.width,
                                                        args.width, w.data_ptr(), args.rows, None, y.data_ptr(),
                                                        args.rows, 1, scratch.data_ptr()))
        for fn, call in calls.values():  # warm-up
            for _ in range(10):
                if fn(*call):
                    raise RuntimeError("a GEMM failed")
        for _ in range(args.repeats):
            for (name, f), (fn, call) in calls.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn(*call)
                per_call = (time.perf_counter() - start) / args.calls
                best[name, f, m] = min(best.get((name, f, m), per_call), per_call)
    rows = []
    print(f"kernels {kernels.isa()}, one thread, {args.rows} x {args.width} weights in cache, "
          f"{args.activation_dtype} activations, fastest of {args.repeats} blocks of {args.calls} calls")
    for f, w in weights.items():
        for m in args.tokens:
            row: dict[str, Any] = {"format": f, "tokens": m, "weight_bytes": w.numel()}
            cells = []
            for name in libs:
                row[f"{name}_us"] = round(best[name, f, m] * 1e6, 3)
                row[f"{name}_gb_per_s"] = round(w.numel() / best[name, f, m] / 1e9, 3)
                cells.append(f"{name} {row[f'{name}_gb_per_s']:6.2f} GB/s")
            if "baseline" in libs:
                row["speedup"] = round(best["baseline", f, m] / best["now", f, m], 4)
                cells.append(f"after / before {row['speedup']:.2f}x")
            rows.append(row)
            print(f"{f:<6} M={m:<3} " + "  ".join(cells))
    if args.json is not None:
        write_record(args.json, {
            "command": "python benchmarks/row_ceiling.py " + " ".join(sys.argv[1:]),
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "kernel_isa": kernels.isa(), "activation_dtype": args.activation_dtype,
            "baseline": str(args.baseline) if args.baseline else None, "matrix": [args.rows, args.width],
            "calls": args.calls, "repeats": args.repeats, "rows": rows,
        })


if __name__ == "__main__":
    main()
