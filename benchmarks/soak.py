"""Soak: thousands of requests, then check that the engine is back where it started.

The traffic mixes what leaks are made of: prompts of mixed length that share one of a
few prefixes (prefix-cache hits and evictions), outputs of 1 to 48 tokens, streams
cancelled by their consumer after a few deltas, requests aborted by id mid-stream,
``n = 2`` sampled requests, and an overlap-mode model swap in the middle of it all.
A warm-up of the same mix (and one swap) comes first, so that allocator pools and
caches that are meant to stay are in the baseline.

At the end, once idle, it checks against the baseline:

- no KV block is held (a block held without a request is a leak), one model version
  is live, no request is in flight, and the metrics track no request;
- every request ended exactly once in ``engine.metrics`` (finish reasons add up to
  the requests sent);
- the process's RSS grew by at most ``--rss-budget`` MiB.

    python benchmarks/soak.py --requests 5000 --json benchmarks/results/soak.json
    python benchmarks/soak.py --model /path/to/model --requests 2000 --concurrency 32

Without ``--model`` it builds a tiny random Llama (the test suite's shape), so the run
stresses the engine's bookkeeping rather than the matmuls. ``tests/metrics/test_soak.py``
runs a short version in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.metrics.device import process_rss_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import tiny_model

MiB = 1024**2


async def one(engine: AsyncEngine, i: int, rng: random.Random, prefixes: list[list[int]], vocab: int) -> str:
    """Request ``i`` of the mix; returns its kind."""
    prompt = rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 64))]
    max_tokens = rng.randrange(1, 49)
    roll = rng.random()
    if roll < 0.15:  # the consumer goes away after a few deltas
        stream = engine.stream(prompt, SamplingParams(max_tokens=max_tokens + 8, ignore_eos=True))
        stop_after = rng.randrange(1, 4)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= stop_after:
                break
        await stream.aclose()
        return "cancelled"
    if roll < 0.25:  # aborted by id mid-stream; the stream ends with the abort's final delta
        request_id = f"soak-{i}"
        async for delta in engine.stream(prompt, SamplingParams(max_tokens=max_tokens + 8, ignore_eos=True),
                                         request_id=request_id):
            if delta.finish_reason is None:
                engine.abort(request_id)
        return "aborted"
    if roll < 0.30:
        await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, n=2, temperature=0.8, seed=i))
        return "n=2"
    await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return "generate"


async def traffic(engine: AsyncEngine, count: int, concurrency: int, rng: random.Random, model: Any,
                  swap_at: int | None) -> dict[str, int]:
    vocab = engine.model_config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(4)]
    gate = asyncio.Semaphore(concurrency)
    kinds: dict[str, int] = {}

    async def run(i: int) -> None:
        async with gate:
            kind = await one(engine, i, random.Random(rng.random()), prefixes, vocab)
        kinds[kind] = kinds.get(kind, 0) + 1
        if i == swap_at:
            await engine.swap_model(model)
            kinds["swaps"] = kinds.get("swaps", 0) + 1

    await asyncio.gather(*(run(i) for i in range(count)))
    return kinds


async def settle(engine: AsyncEngine, timeout: float = 60.0) -> None:
    """Wait until no request is in flight, no block is held and one version is live."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
        if idle and len(engine.model_info()) == 1:
            return
        await asyncio.sleep(0.02)


def state(engine: AsyncEngine) -> dict[str, Any]:
    gc.collect()
    report = engine.memory_report()
    snap = engine.metrics.snapshot().models["default"]
    return {
        "rss_mib": process_rss_bytes() / MiB,
        "used_blocks": sum(m.used_blocks for m in report.models),
        "versions_live": len(report.models),
        "requests_in_flight": engine.num_unfinished_requests,
        "tracked_by_metrics": engine.metrics.num_tracked_requests,
        "running": snap.running,
        "waiting": snap.waiting,
        "requests_ended": sum(snap.requests.values()),
        "by_reason": dict(snap.requests),
    }


async def soak(model: Any, *, requests: int, concurrency: int, seed: int = 0, warmup: int = 100,
               rss_budget_mib: float = 64.0, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the soak and return its figures; ``result["ok"]`` says whether every check held."""
    rng = random.Random(seed)
    opts = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kv_cache_memory": 8 * MiB,
            "memory_bandwidth": 1e10, **(options or {})}
    engine = await AsyncEngine.load(model, **opts)  # off the loop, as the engine asks (from_pretrained warned)
    start = time.perf_counter()
    async with engine:
        await traffic(engine, warmup, concurrency, rng, model, swap_at=warmup // 2)
        await settle(engine)
        baseline = state(engine)
        kinds = await traffic(engine, requests, concurrency, rng, model, swap_at=requests // 2)
        await settle(engine)
        after = state(engine)
    elapsed = time.perf_counter() - start
    checks = {
        "no block held": after["used_blocks"] == 0,
        "one version live": after["versions_live"] == 1,
        "no request in flight": after["requests_in_flight"] == after["running"] == after["waiting"] == 0,
        "metrics track no request": after["tracked_by_metrics"] == 0,
        "every request ended once": after["requests_ended"] - baseline["requests_ended"] == requests,
        "rss within budget": after["rss_mib"] - baseline["rss_mib"] <= rss_budget_mib,
    }
    return {"requests": requests, "concurrency": concurrency, "seed": seed, "kinds": kinds,
            "seconds": round(elapsed, 1), "baseline": baseline, "after": after,
            "rss_growth_mib": round(after["rss_mib"] - baseline["rss_mib"], 1), "rss_budget_mib": rss_budget_mib,
            "checks": checks, "ok": all(checks.values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or .gguf (default: a tiny random Llama)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-budget", type=float, default=64.0, help="allowed RSS growth in MiB")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    model = args.model or tiny_model(Path(tempfile.mkdtemp(prefix="asyncinfer-soak-")))
    result = asyncio.run(soak(model, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                              rss_budget_mib=args.rss_budget))
    result["command"] = "python " + " ".join(sys.argv)
    result["model"] = str(args.model) if args.model else "tiny random llama (2 layers, hidden 64)"
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(f"{args.requests} requests in {result['seconds']} s; RSS {result['baseline']['rss_mib']:.1f} -> "
          f"{result['after']['rss_mib']:.1f} MiB; ended by reason: {result['after']['by_reason']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
