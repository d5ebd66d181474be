"""Dynamic batching of embeddings: throughput and latency with batching on and off.

One engine holds all-MiniLM-L6-v2 several times under different names, one per
batching setting (``add_model``), so every setting runs in the same process on
the same weights. At each concurrency level, ``C`` closed-loop clients each send
one sentence per ``embed()`` call, back to back, until ``--requests`` calls have
finished; the settings take turns at each level, so machine noise hits them alike.

    python benchmarks/embeddings.py                      # the table in benchmarks/README.md
    python benchmarks/embeddings.py --concurrency 1 8 32 --requests 256 --json out.json
    python benchmarks/embeddings.py --with-generator 8      # the same, while SmolLM2 serves 8 chat streams

``--with-generator N`` adds the default generator to the same engine and keeps N
clients streaming 64-token answers from it during the measurements: embedding
batches then run between generation steps, and the rows also report the
generator's tokens per second.

Reported per setting and level: calls per second, latency p50 / p99 (ms), mean
batch size; and the on/off ratios (throughput gained, latency paid). First, the
cost of one forward pass at batch sizes 1..32 (the encoder alone, median of 7),
which bounds what batching can buy on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QUESTIONS, git_commit, machine_info, percentile

from asyncinfer import AsyncEngine, on_own_thread

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"max_batch_size": 1},  # every call alone: no batching
    "on": {"max_batch_size": 32, "max_wait_ms": 5.0},  # the default: wait up to 5 ms for up to 32 texts
    "on-nowait": {"max_batch_size": 32, "max_wait_ms": 0.0},  # take whatever is queued, never wait
    # batched as "on", each text in a pass of its own: its vector depends on it alone (not run by default)
    "invariant": {"max_batch_size": 32, "max_wait_ms": 5.0, "batch_invariant": True},
}
DEFAULT_SETTINGS = ["off", "on", "on-nowait"]


class Background:
    """N clients streaming chat answers from the generator "gen" until stopped; counts tokens."""

    def __init__(self, engine: AsyncEngine, clients: int) -> None:
        self.engine = engine
        self.tokens = 0
        self.stopping = False
        self.tasks = [asyncio.create_task(self.client(i)) for i in range(clients)]

    async def client(self, i: int) -> None:
        from asyncinfer import SamplingParams

        rng = random.Random(i)
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        while not self.stopping:
            messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
            async for delta in self.engine.stream(messages, params, model="gen"):
                self.tokens += len(delta.token_ids)

    async def stop(self) -> None:
        self.stopping = True
        await asyncio.gather(*self.tasks)


async def run_level(
    engine: AsyncEngine, name: str, concurrency: int, requests: int, seed: int, background: Background | None = None
) -> dict[str, Any]:
    rng = random.Random(seed)
    texts = [rng.choice(QUESTIONS) for _ in range(requests)]
    latencies: list[float] = []
    next_index = 0
    before = engine.embedding_stats(name)
    gen_before = background.tokens if background else 0

    async def client() -> None:
        nonlocal next_index
        while next_index < requests:
            text = texts[next_index]
            next_index += 1
            start = time.perf_counter()
            await engine.embed(text, model=name)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = engine.embedding_stats(name)
    batches = after.num_batches - before.num_batches
    return {
        "setting": name,
        "concurrency": concurrency,
        "calls": len(latencies),
        "calls_per_s": len(latencies) / wall,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "mean_batch": (after.num_texts - before.num_texts) / batches if batches else 0.0,
        "gen_tok_s": (background.tokens - gen_before) / wall if background else None,
    }


def batch_cost(engine: AsyncEngine, name: str, sizes: list[int]) -> list[dict[str, Any]]:
    """Median wall time of one forward pass per batch size, on the workload's texts."""
    encoder = engine._models.embedder(name).batcher.encoder
    rng = random.Random(0)
    rows = []
    for size in sizes:
        ids = encoder.tokenize([rng.choice(QUESTIONS) for _ in range(size)])
        encoder.encode_ids(ids)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            encoder.encode_ids(ids)
            times.append(time.perf_counter() - start)
        ms = 1000 * statistics.median(times)
        rows.append({"batch": size, "tokens": sum(map(len, ids)), "ms": ms, "texts_per_s": 1000 * size / ms})
        print(f"  batch {size:<3} {rows[-1]['tokens']:5d} tokens  {ms:7.1f} ms  {rows[-1]['texts_per_s']:7.1f} texts/s",
              flush=True)
    return rows


async def main_async(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    first, *rest = args.settings
    device = {"device": args.device, "dtype": args.dtype}
    if args.max_busy_share is not None:
        device["max_busy_share"] = args.max_busy_share
    engine = await AsyncEngine.load(args.model, name=first, num_threads=args.threads, **device, **SETTINGS[first])
    rows: list[dict[str, Any]] = []
    print("one forward pass (before the engine starts):")
    # On a thread that ends with it: the loop's thread must not keep an OpenMP team (docs/formats.md).
    costs = on_own_thread(batch_cost, engine, first, [1, 2, 4, 8, 16, 32])
    print("closed-loop clients:")
    async with engine:
        for name in rest:
            await engine.add_model(name, args.model, **device, **SETTINGS[name])
        background = None
        if args.with_generator:
            await engine.add_model("gen", None, max_model_len=1024, kv_cache_memory=256 * 2**20)
            background = Background(engine, args.with_generator)
            await asyncio.sleep(5)  # let the streams get past their prefills
        for name in args.settings:  # warm-up: first calls pay for allocator growth
            await asyncio.gather(*(engine.embed("warm-up text", model=name) for _ in range(64)))
        for concurrency in args.concurrency:
            requests = max(args.requests, 8 * concurrency)
            for name in args.settings:
                row = await run_level(engine, name, concurrency, requests, seed=concurrency, background=background)
                rows.append(row)
                gen = f"  generator {row['gen_tok_s']:6.1f} tok/s" if background else ""
                print(
                    f"  C={concurrency:<3} {name:<10} {row['calls_per_s']:8.1f} calls/s  "
                    f"p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  mean batch {row['mean_batch']:5.1f}{gen}",
                    flush=True,
                )
        if background:
            await background.stop()
    return costs, rows


def table(rows: list[dict[str, Any]], settings: list[str]) -> str:
    by = {(r["concurrency"], r["setting"]): r for r in rows}
    gen = rows[0]["gen_tok_s"] is not None
    lines = [
        "| clients | setting | calls/s | p50 ms | p99 ms | mean batch | calls/s vs off | p99 vs off |"
        + (" generator tok/s |" if gen else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if gen else ""),
    ]
    for concurrency in sorted({r["concurrency"] for r in rows}):
        off = by.get((concurrency, "off"))
        for name in settings:
            r = by[(concurrency, name)]
            ratio = f"{r['calls_per_s'] / off['calls_per_s']:.2f}x" if off else "-"
            p99 = f"{r['p99_ms'] / off['p99_ms']:.2f}x" if off else "-"
            lines.append(
                f"| {concurrency} | {name} | {r['calls_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} "
                f"| {r['mean_batch']:.1f} | {ratio} | {p99} |" + (f" {r['gen_tok_s']:.1f} |" if gen else "")
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="embedding model (name or directory)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=256, help="calls per level and setting (at least 8 x C)")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS),
                        help=f"batching settings to compare (default: {' '.join(DEFAULT_SETTINGS)})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bf16 on CUDA), float32, ...")
    parser.add_argument("--with-generator", type=int, default=0, metavar="N",
                        help="keep N chat streams of the default generator running in the same engine")
    parser.add_argument("--max-busy-share", type=float, default=None, metavar="S",
                        help="each setting's max_busy_share (default: the engine's, 0.2; 1 = a batch between every two "
                        "generation steps, the behaviour before the option existed)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and the machine here")
    args = parser.parse_args()
    print(f"embedding benchmark: {args.model}, settings {args.settings}, clients {args.concurrency}")
    costs, rows = asyncio.run(main_async(args))
    print()
    print(table(rows, args.settings))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"command": " ".join(["python", *sys.argv]), "commit": git_commit(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average": os.getloadavg(),
                   "machine": machine_info(), "settings": SETTINGS, "batch_cost": costs, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwritten to {args.json}")


if __name__ == "__main__":
    main()
