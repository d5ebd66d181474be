"""An embedding flood beside a generator: what it costs a neighbour's stream, at each ``max_busy_share``.

One engine holds the default generator and all-MiniLM-L6-v2 once per share in ``--shares`` (``add_model``
under its own name, the same weights). A neighbour streams ``--tokens`` greedy tokens; beside it, in each
case, ``--flooders`` callers send ``embed()`` calls of ``--texts`` long texts (past the encoder's 256 tokens)
back to back to the model of that case's share, for the neighbour's whole stream. The cases take turns in
each of ``--rounds`` rounds:

- ``alone``: no flood;
- ``share=S``: the flood, on the model whose ``max_busy_share`` is S (1.0 is a batch between every two
  generation steps, as soon as one is due: the engine's behaviour before the share existed).

Reported per case (medians over rounds): the neighbour's mean time per output token (its first delta to its
last, over the tokens between), its median and longest gap, the ratio of its mean to ``alone``'s, and the
flood's texts embedded a second while the neighbour streamed.

    python benchmarks/embedding_share.py --json benchmarks/results/embedding_share.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info

from asyncinfer import AsyncEngine, SamplingParams

LONG_TEXT = " ".join(f"word{i} river mountain" for i in range(200))  # about 2,400 characters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5, 0.2], metavar="S")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256, help="tokens the neighbour streams (long enough for a few "
                   "of the flood's batches at the smallest share)")
    p.add_argument("--flooders", type=int, default=6, help="callers sending embed() calls back to back")
    p.add_argument("--texts", type=int, default=256, help="texts in each flood call")
    p.add_argument("--threads", type=int, default=None, help="torch threads (num_threads)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


async def one_case(engine: AsyncEngine, model: str | None, args: argparse.Namespace) -> dict[str, float]:
    stop = asyncio.Event()
    embedded = 0

    async def flood() -> None:
        nonlocal embedded
        while not stop.is_set():
            await engine.embed([LONG_TEXT] * args.texts, model=model)
            embedded += args.texts

    floods = [asyncio.create_task(flood()) for _ in range(args.flooders if model else 0)]
    if model:
        start = engine.embedding_stats(model).num_batches
        while engine.embedding_stats(model).num_batches == start:  # the flood is under way
            await asyncio.sleep(0.005)
    before = engine.embedding_stats(model).num_texts if model else 0
    stamps: list[float] = []
    tokens = 0
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    async for delta in engine.stream("Tell me a long story about a river.", params, model="gen"):
        stamps.append(time.perf_counter())
        tokens += len(delta.token_ids)
    texts = (engine.embedding_stats(model).num_texts - before) if model else 0
    stop.set()
    for task in floods:  # the calls in flight are not waited out: their texts are dropped
        task.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    span = stamps[-1] - stamps[0]
    return {
        "tokens": tokens,
        "mean_tpot_ms": 1000 * span / max(1, tokens - 1),
        "median_gap_ms": 1000 * statistics.median(gaps),
        "max_gap_ms": 1000 * max(gaps),
        "texts_per_s": texts / span,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    threads = {"num_threads": args.threads} if args.threads else {}
    engine = await AsyncEngine.load(None, name="gen", max_model_len=1024, **threads)
    cases: dict[str, str | None] = {"alone": None}
    async with engine:
        for share in args.shares:
            name = f"share={share:g}"
            await engine.add_model(name, "all-MiniLM-L6-v2", max_busy_share=share, **threads)
            cases[name] = name
        await engine.generate("Warm up.", SamplingParams(max_tokens=4))
        await engine.embed([LONG_TEXT] * 8, model=cases[f"share={args.shares[0]:g}"])
        rounds: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
        for r in range(args.rounds):
            for case, model in cases.items():
                result = await one_case(engine, model, args)
                rounds[case].append(result)
                print(f"round {r + 1} {case:>10}: mean TPOT {result['mean_tpot_ms']:7.1f} ms, median gap "
                      f"{result['median_gap_ms']:6.1f} ms, longest {result['max_gap_ms']:7.1f} ms, "
                      f"{result['texts_per_s']:6.1f} texts/s", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for case, results in rounds.items():
        summary[case] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    alone = summary["alone"]["mean_tpot_ms"]
    for figures in summary.values():
        figures["mean_tpot_vs_alone"] = figures["mean_tpot_ms"] / alone
    return {"summary": summary, "rounds": rounds}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print("\ncase         mean TPOT   x alone   median gap   longest gap   flood texts/s")
    for case, s in result["summary"].items():
        print(f"{case:>10}   {s['mean_tpot_ms']:7.1f} ms   {s['mean_tpot_vs_alone']:5.2f}x   {s['median_gap_ms']:7.1f} ms"
              f"   {s['max_gap_ms']:8.1f} ms   {s['texts_per_s']:8.1f}")
    if args.json:
        record = {"command": " ".join(["python", "benchmarks/embedding_share.py", *(argv or sys.argv[1:])]),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
                  "settings": {**vars(args), "json": str(args.json)}, "load_average": os.getloadavg(),
                  "machine": machine_info(), **result}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
