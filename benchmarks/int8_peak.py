"""How near the int8 tile runs to one core's int8 multiply-add peak, and what that peak allows a workload.

Three figures, each from this machine in one run:

1. **the peak**: a C probe (compiled here with ``cc``) runs only 512-bit int8 multiply-adds, the instruction
   the tile is built on (``vpdpbusd`` on the ``avx512vnni`` build, the ``vpmaddubsw`` + ``vpmaddwd`` pair on
   ``avx512``: 64 products either way), in 8, 12 and 16 independent chains, three runs each, keeping the best
   (the chains' loop unrolled with ``#pragma GCC unroll``, so that GCC -O2 keeps them in registers; before ad04757
   it kept them in memory, each multiply-add waiting on a store and a load, and the probe read about half of a Zen
   4 core's peak, ad hoc; the ``int8_peak_*_epyc.json`` records predate the fix; 24 and 28 chains, tried with the
   fix, spilled again): multiply-adds a second on one core, timed on the thread's CPU clock (so another process's
   load does not count);
2. **the tile**: ``kernels.gemm(..., activation_dtype="int8", int8_kernel="tile")`` over one decoder layer's
   projections of a real shape (q, k, v, o, gate, up, down), one thread, CPU clock, best of ``--repeats``, at
   each of ``--tokens`` rows and ``--formats``: multiply-adds a second and their share of the peak;
3. **the floor of a workload** (with ``--peer-json``, a record of ``benchmarks/peer.py``, and ``--model``, the
   GGUF it ran): the seconds its prompt and output tokens take at the peak on ``--threads`` cores, counting
   only the weights' multiply-adds (every matrix but the token embedding, the output head once per request
   in a prefill; attention, norms, sampling and scheduling cost nothing here), against llama.cpp's best
   wall time in that record: the most any engine with these products could be ahead of it, and the share of
   the peak that ``--target`` times llama.cpp's rate needs over the whole workload.

    python benchmarks/int8_peak.py --json benchmarks/results/int8_peak_epyc.json \\
        --peer-json benchmarks/results/peer_1b_q4_k_m_int8_tile_epyc.json --model llama-1b-q4_k_m.gguf
    python benchmarks/int8_peak.py --shape tiny --repeats 1 --tokens 16      # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import git_commit, machine_info, write_record

from asyncinfer import kernels

#: (hidden, intermediate, q heads * head dim, kv heads * head dim), as benchmarks/kquant_rows.py's shapes.
SHAPES = {
    "tiny": (256, 512, 256, 128),
    "1b": (2048, 8192, 2048, 512),
    "3b": (3072, 8192, 3072, 1024),
}

PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#ifndef CHAINS
#error CHAINS
#endif
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(void) {
    __m512i acc[CHAINS];
    __m512i u = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
    const long n = ITERATIONS;
    const double t0 = now();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 64
        for (int i = 0; i < CHAINS; i++) { /* unrolled, so that the chains stay in registers */
#ifdef VNNI
            acc[i] = _mm512_dpbusd_epi32(acc[i], u, x);
#else
            acc[i] = _mm512_add_epi32(acc[i], _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
        }
        __asm__ volatile("" : "+v"(u), "+v"(x));
    }
    const double s = now() - t0;
    long sum = 0;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_epi32(acc[i]);
    printf("%.6f %ld\n", s, sum);
    return 0;
}
"""

ISA_FLAGS = {"avx512vnni": ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-DVNNI"], "avx512": ["-mavx512f", "-mavx512bw"]}


#: The probe's fewest loops a chain: below this its few milliseconds of multiply-adds are lost in the timer's and the
#: process's own cost (a smoke run of 10 read 5 G multiply-adds a second, a tile "747% of the peak").
MIN_ITERATIONS = 1_000_000


def probe_peak(isa: str, iterations: int) -> dict[str, Any]:
    """The best multiply-adds a second of one core over 8-16 chains, and each count's rate."""
    rates: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.c"
        source.write_text(PROBE)
        for chains in (8, 12, 16):
            exe = Path(tmp) / f"probe{chains}"
            subprocess.run([os.environ.get("CC", "cc"), "-O2", *ISA_FLAGS[isa], f"-DCHAINS={chains}",
                            f"-DITERATIONS={iterations}L", str(source), "-o", str(exe)], check=True)
            seconds = min(float(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()[0])
                          for _ in range(3))  # the best of three runs
            rates[chains] = iterations * chains * 64 / seconds
    best = max(rates, key=rates.__getitem__)
    return {"instruction": "vpdpbusd" if isa == "avx512vnni" else "vpmaddubsw+vpmaddwd", "best_chains": best,
            "macs_per_s": rates[best], "macs_per_s_by_chains": rates}


def tile_rates(shape: str, formats: list[str], tokens: list[int], repeats: int) -> list[dict[str, Any]]:
    """The tile's multiply-adds a second on one thread over one layer's projections, per format and rows."""
    hidden, inter, q, kv = SHAPES[shape]
    mats = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in formats:
        packed = [(kernels.pack(kernels.quantize(torch.randn(n, k, generator=gen) * 0.02, fmt), fmt), n, k)
                  for n, k in mats]
        for m in tokens:
            xs = {k: torch.randn(m, k, generator=gen) for k in {hidden, q, inter}}
            best = float("inf")
            for r in range(repeats + 1):  # the first pass warms up
                start = time.thread_time()
                for p, n, k in packed:
                    kernels.gemm(xs[k], p, fmt, n, activation_dtype="int8", int8_kernel="tile")
                elapsed = time.thread_time() - start
                if r:
                    best = min(best, elapsed)
            macs = m * sum(n * k for n, k in mats)
            rows.append({"format": fmt, "tokens": m, "seconds": best, "macs_per_s": macs / best})
    return rows


def model_macs(path: Path) -> dict[str, int]:
    """Multiply-adds a token of the GGUF's weight matrices: the layers' (every 2-D tensor but the token embedding
    and the output head) and the head's (the token embedding where the file has no output tensor: tied)."""
    from gguf import GGUFReader

    layers = head = 0
    embedding = 0
    has_output = False
    for t in GGUFReader(str(path)).tensors:
        count = int(t.n_elements)
        if len(t.shape) < 2:
            continue
        if t.name == "token_embd.weight":
            embedding = count
        elif t.name == "output.weight":
            head, has_output = count, True
        else:
            layers += count
    return {"layers": layers, "head": head if has_output else embedding}


def workload_floor(peer: dict[str, Any], macs: dict[str, int], peak: float, threads: int,
                   target: float) -> dict[str, Any]:
    """The seconds the peer record's 32-request workload takes at ``threads`` cores' peak, weights only."""
    work = peer["workload"]
    prompt, output, requests = work["prompt_tokens"], work["output_tokens"], work["num_requests"]
    # a prefill runs the layers on every prompt token and the head on one row a request (its first token);
    # each later output token runs everything once
    prefill = prompt * macs["layers"] + requests * macs["head"]
    decode = (output - requests) * (macs["layers"] + macs["head"])
    seconds = (prefill + decode) / (peak * threads)
    best_slots = str(peer["many"]["llama_cpp_best_slots"])
    llama_wall = peer["many"]["llama_cpp_by_slots"][best_slots]["wall_s"]
    return {
        "prompt_tokens": prompt, "output_tokens": output, "num_requests": requests, "macs_per_token": macs,
        "prefill_macs": prefill, "decode_macs": decode, "threads": threads,
        "floor_s": seconds, "llama_cpp_best_slots": int(best_slots), "llama_cpp_wall_s": llama_wall,
        "most_ahead_of_llama_cpp": llama_wall / seconds,
        "target": target, "share_of_peak_the_target_needs": seconds / (llama_wall / target),
        "asyncinfer_cache_off_tokens_per_s": peer["many"]["asyncinfer_prefix_cache_off_tokens_per_s"],
        "asyncinfer_cache_off_share_of_peak": seconds / (output / peer["many"]["asyncinfer_prefix_cache_off_tokens_per_s"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--formats", nargs="+", choices=kernels.BLOCK_FORMATS, default=["q4_0", "q4_k", "q6_k", "q8_0"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=50_000_000,
                    help=f"the probe's loop count per chain (at least {MIN_ITERATIONS:,}: fewer time the process more "
                         "than the multiply-adds)")
    ap.add_argument("--peer-json", type=Path, default=None, help="a benchmarks/peer.py record for the floor")
    ap.add_argument("--model", type=Path, default=None, help="the GGUF file that record ran (its matrices)")
    ap.add_argument("--threads", type=int, default=2, help="cores the peer record ran on (default 2)")
    ap.add_argument("--target", type=float, default=2.0, help="the ratio to llama.cpp asked for (default 2)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if (args.peer_json is None) != (args.model is None):
        ap.error("--peer-json and --model go together")
    if args.iterations < MIN_ITERATIONS:
        ap.error(f"--iterations must be at least {MIN_ITERATIONS:,}, got {args.iterations}")
    if not kernels.available():
        raise SystemExit(f"the kernels cannot run here: {kernels.unavailable_reason()}")
    isa = kernels.isa()
    if isa not in ISA_FLAGS:
        raise SystemExit(f"the int8 tile runs on the avx512 and avx512vnni builds; this machine's is {isa}")
    torch.set_num_threads(1)
    peak = probe_peak(isa, args.iterations)
    print(f"kernels {isa}: one core's peak {peak['macs_per_s'] / 1e9:.1f} G multiply-adds/s "
          f"({peak['instruction']}, {peak['best_chains']} chains)")
    with torch.inference_mode():
        rows = tile_rates(args.shape, args.formats, args.tokens, args.repeats)
    for row in rows:
        row["share_of_peak"] = row["macs_per_s"] / peak["macs_per_s"]
        print(f"  tile {row['format']:<5} M={row['tokens']:<4} {row['macs_per_s'] / 1e9:6.1f} G/s "
              f"({row['share_of_peak']:.0%} of the peak)")
    floor = None
    if args.peer_json is not None:
        peer = json.loads(args.peer_json.read_text())
        floor = workload_floor(peer, model_macs(args.model), peak["macs_per_s"], args.threads, args.target)
        print(f"workload of {args.peer_json.name}: {floor['prompt_tokens']} prompt + {floor['output_tokens']} output "
              f"tokens take at least {floor['floor_s']:.2f} s at the peak of {args.threads} cores (weights only); "
              f"llama.cpp's best took {floor['llama_cpp_wall_s']:.2f} s: no engine with these products can be more "
              f"than {floor['most_ahead_of_llama_cpp']:.2f}x ahead; {args.target:g}x needs "
              f"{floor['share_of_peak_the_target_needs']:.0%} of the peak over the whole workload (asyncinfer without "
              f"the prefix cache ran at {floor['asyncinfer_cache_off_share_of_peak']:.0%})")
    if args.json is not None:
        write_record(args.json, {
            "command": "python benchmarks/int8_peak.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine_info(), "load_average": os.getloadavg(),
            "shape": args.shape, "peak": peak, "tile": rows, "floor": floor,
            "peer_json": str(args.peer_json) if args.peer_json else None,
        })


if __name__ == "__main__":
    main()
