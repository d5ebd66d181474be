"""Decode attention alone: the Triton paged-decode backend against the SDPA backend, on one device.

For each batch size and context length, a step of decodes only (every sequence the same context, its blocks
scattered at random through the cache, as a running engine's are) is timed through each backend's
``forward`` (the new token's K/V written, then attention; the metadata built once, as the engine builds it
once a step for all layers): ``TritonDecodeBackend`` reads K/V from the blocks in place, ``SdpaBackend``
gathers them first. Reported per row: microseconds per call of each, the Triton kernel's K/V bytes per call
over its time (the bandwidth it reached), and the largest difference between the two outputs.

The default shape is one layer of Llama-3-8B's attention (32 query heads, 8 KV heads, head size 128,
bfloat16, blocks of 16 tokens). On CUDA the times come from CUDA events after warm-up; on a CPU
(``--device cpu``) the kernel runs in Triton's interpreter (this script sets ``TRITON_INTERPRET=1`` before
Triton is imported, in its own process): a smoke run whose times mean nothing.

    python benchmarks/paged_decode.py --device cuda --json "$OUT/paged_decode_cuda.json"
    python benchmarks/paged_decode.py --device cpu --batch 2 --context 20 --iters 1 --heads 4 --kv-heads 2 \\
        --head-dim 16 --block-size 4 --dtype float32                                   # smoke test
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, write_record

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads or min(args.batch + args.context) < 1 or args.iters < 1:
        parser.error("--heads must be a multiple of --kv-heads; batches, contexts and --iters >= 1")
    return args


def time_calls(fn: Any, device: str, warmup: int, iters: int) -> float:
    """Median microseconds per call of ``fn()`` (CUDA events on a GPU, the wall clock elsewhere)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(times)


def run_row(args: argparse.Namespace, batch: int, context: int) -> dict[str, Any]:
    import torch

    from asyncinfer.models.attention.sdpa import SdpaBackend
    from asyncinfer.models.attention.triton_backend import TritonDecodeBackend

    dtype = getattr(torch, args.dtype)
    bs, kvh, d = args.block_size, args.kv_heads, args.head_dim
    per_seq = -(-context // bs)
    num_blocks = batch * per_seq + 1
    ids = list(range(1, num_blocks))
    random.Random(batch * 7919 + context).shuffle(ids)
    tables = [ids[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    slots = [table[(context - 1) // bs] * bs + (context - 1) % bs for table in tables]
    gen = torch.Generator(device=args.device).manual_seed(0)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=args.device).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=args.device).to(dtype)
    q = torch.randn(batch, args.heads, d, generator=gen, device=args.device).to(dtype)
    k = torch.randn(batch, kvh, d, generator=gen, device=args.device).to(dtype)
    v = torch.randn(batch, kvh, d, generator=gen, device=args.device).to(dtype)
    scale = d**-0.5
    row: dict[str, Any] = {"batch": batch, "context": context}
    outputs = {}
    for name, backend in (("triton", TritonDecodeBackend()), ("sdpa", SdpaBackend())):
        meta = backend.build_metadata(query_lens=[1] * batch, context_lens=[context] * batch, block_tables=tables,
                                      slot_mapping=slots, block_size=bs, device=args.device)
        outputs[name] = backend.forward(q, k, v, (k_cache, v_cache), meta, scale)
        def call(backend: Any = backend, meta: Any = meta) -> Any:
            return backend.forward(q, k, v, (k_cache, v_cache), meta, scale)

        row[f"{name}_us"] = round(time_calls(call, args.device, args.warmup, args.iters), 2)
    kv_bytes = 2 * batch * context * kvh * d * k_cache.element_size()
    row["kv_bytes"] = kv_bytes
    row["triton_gb_per_s"] = round(kv_bytes / row["triton_us"] / 1e3, 1)
    row["sdpa_over_triton"] = round(row["sdpa_us"] / row["triton_us"], 2)
    row["max_abs_diff"] = float((outputs["triton"].float() - outputs["sdpa"].float()).abs().max())
    print(f"batch {batch:3d} context {context:6d}: triton {row['triton_us']:9.1f} us "
          f"({row['triton_gb_per_s']:7.1f} GB/s), sdpa {row['sdpa_us']:9.1f} us, "
          f"x{row['sdpa_over_triton']}, max |diff| {row['max_abs_diff']:.3g}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: this process only
    import torch
    import triton

    if args.device == "cuda" and not torch.cuda.is_available():
        print("paged_decode.py: torch sees no CUDA device", file=sys.stderr)
        return 1
    rows = [run_row(args, batch, context) for batch in args.batch for context in args.context]
    record = {
        "benchmark": "paged_decode",
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter: a smoke run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "block_size": args.block_size},
        "iters": args.iters,
        "rows": rows,
    }
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
