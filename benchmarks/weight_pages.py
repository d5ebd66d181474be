"""Speed of the row kernels with the same weights in three kinds of memory: plain anonymous memory in small pages
(``torch.empty``, what the repacked weights were held in before ``kernels.weight_buffer``), huge pages
(``kernels.weight_buffer``, where Linux grants them) and a private map of a file (how a GGUF file's blocks in
the kernels' own layout are multiplied in place: ``GGUFFile``'s ``ACCESS_COPY`` map, the file in the page cache).

The weights are ``kquant_rows``' (one GEMM call per projection of ``--layers`` 1B-shaped decoder layers, too many
to stay in cache), each kind its own copy of the same bytes; the kinds take turns pass by pass, in an order that
flips every pass, and each pass's time is kept. Printed per format and M: GB/s of weights at the fastest pass of
each kind and the huge / small and file / small ratios of the medians.

    python benchmarks/weight_pages.py --threads 2 --formats q4_0 q4_1 q8_0 q4_k q6_k --tokens 1 4
    python benchmarks/weight_pages.py --threads 2 --json benchmarks/results/weight_pages_zen4.json
"""

from __future__ import annotations

import argparse
import datetime
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info, write_record
from kquant_rows import CHOICES, SHAPES, Weights, layer_matrices, library_pass, typed_library

from asyncinfer import kernels

KINDS = ("small", "huge", "file")


def copies(w: Weights, directory: Path) -> dict[str, list[tuple[torch.Tensor, int, int]]]:
    """The weights' matrices in each kind of memory (the file's map stays open as long as its tensors)."""
    small = [(torch.empty_like(p).copy_(p), n, k) for p, n, k in w.mats]
    huge = [(kernels.weight_buffer(p.numel()).view(p.shape).copy_(p), n, k) for p, n, k in w.mats]
    path = directory / f"{w.fmt}.bin"
    offsets = []
    with open(path, "wb") as fh:
        for p, _, _ in w.mats:
            offsets.append(fh.tell())
            fh.write(p.numpy().tobytes())
    with open(path, "rb") as fh:
        region = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    mapped = [(whole[o:o + p.numel()].view(p.shape), n, k) for o, (p, n, k) in zip(offsets, w.mats)]
    return {"small": small, "huge": huge, "file": mapped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", nargs="+", choices=CHOICES, default=["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit(f"asyncinfer's kernels are unavailable: {kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    run = library_pass(typed_library(kernels.build_info()["path"]), args.threads)
    widths = sorted({k for _, k in layer_matrices(args.shape)})
    passes: dict[tuple[str, str, int], list[float]] = {}
    nbytes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for fmt in args.formats:
            w = Weights(fmt, args.shape, args.layers, 0)
            nbytes[fmt] = w.nbytes
            held = copies(w, Path(tmp))
            views = {}
            for kind in KINDS:
                v = Weights.__new__(Weights)
                v.fmt, v.mats, v.nbytes = fmt, held[kind], w.nbytes
                views[kind] = v
            for m in args.tokens:
                gen = torch.Generator().manual_seed(m)
                xs = {k: torch.randn(m, k, generator=gen) for k in widths}
                for kind in KINDS:  # warm-up
                    run(views[kind], xs)
                for rep in range(args.repeats):
                    for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                        start = time.perf_counter()
                        run(views[kind], xs)
                        passes.setdefault((fmt, str(m), kind), []).append(time.perf_counter() - start)
            rows = []
            for m in args.tokens:
                med = {kind: statistics.median(passes[fmt, str(m), kind]) for kind in KINDS}
                best = {kind: w.nbytes / min(passes[fmt, str(m), kind]) / 1e9 for kind in KINDS}
                rows.append(f"  M={m}: " + ", ".join(f"{kind} {best[kind]:.1f}" for kind in KINDS) +
                            f" GB/s; huge / small {med['small'] / med['huge']:.2f}x, "
                            f"file / small {med['small'] / med['file']:.2f}x")
            print(f"{fmt} ({w.nbytes / 1e6:.1f} MB):\n" + "\n".join(rows), flush=True)
    print(f"kernels {kernels.isa()}, {args.threads} thread(s), huge pages granted: {kernels.huge_pages()}")
    if args.json is not None:
        write_record(args.json, record(args, passes, nbytes))


def record(args: argparse.Namespace, passes: dict[tuple[str, str, int], list[float]],
           nbytes: dict[str, int]) -> dict[str, Any]:
    rows = []
    for (fmt, m, kind), times in passes.items():
        rows.append({"format": fmt, "tokens": int(m), "memory": kind, "seconds": [round(t, 6) for t in times],
                     "min_s": min(times), "median_s": statistics.median(times),
                     "best_gb_per_s": round(nbytes[fmt] / min(times) / 1e9, 3)})
    ratios = []
    for fmt in args.formats:
        for m in args.tokens:
            med = {kind: statistics.median(passes[fmt, str(m), kind]) for kind in KINDS}
            ratios.append({"format": fmt, "tokens": m, "huge_over_small": round(med["small"] / med["huge"], 4),
                           "file_over_small": round(med["small"] / med["file"], 4)})
    return {
        "command": "python benchmarks/weight_pages.py " + " ".join(sys.argv[1:]),
        "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "load_average_after": os.getloadavg(), "kernel_isa": kernels.isa(),
        "huge_pages_granted": kernels.huge_pages(),
        "thp_enabled": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() else None,
        "shape": args.shape, "layers": args.layers, "threads": args.threads, "repeats": args.repeats,
        "weight_bytes": nbytes,
        "what": "seconds of one pass of one GEMM call per projection over the layers, the same weights in small "
                "pages, huge pages and a file map, interleaved pass by pass; ratios of the median passes",
        "passes": rows, "speedups": ratios,
    }


if __name__ == "__main__":
    main()
