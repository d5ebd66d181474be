"""What a long waiting queue costs a running stream, per scheduling policy.

One caller queues ``--waiting`` requests that cannot start (``max_num_seqs=2``: a long-running blocker and the
neighbour hold both seats) while a neighbour streams greedy tokens; the neighbour's time per token over
``--window`` seconds is measured for each policy and queue length, in interleaved rounds (the median over
``--rounds``), and the time to cancel the queue. A policy that ranks every waiting request at every step adds that work to every
running request's tokens; one that reads its queue from the head does not. The model is tiny (a 2-layer random
Llama: a step costs about a millisecond), so the scheduler's share shows; on one thread.

    python benchmarks/waiting_queue.py --json benchmarks/results/waiting_queue.json
    python benchmarks/waiting_queue.py --waiting 0 500 --rounds 1 --window 0.3     # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import git_commit, machine_info, tiny_model, write_record

from asyncinfer import AsyncEngine, SamplingParams

POLICIES = ("fifo", "aging-priority", "length-bucket", "pd-split")
#: The blocker's and the neighbour's lengths: both outlast any timing window.
LONG = 16_000


async def neighbour_tpot(engine: AsyncEngine, waiting: int, window: float) -> dict[str, float]:
    """The neighbour's time per token over ``window`` seconds with ``waiting`` requests queued behind the two
    seats (its deltas timed as they arrive, from a moment after the queue is built: the ones produced while it was
    being built reach the loop together)."""
    blocker = engine.stream([7, 8, 9], SamplingParams(max_tokens=LONG, ignore_eos=True))
    await blocker.__anext__()
    neighbour = engine.stream([11, 12, 13, 14], SamplingParams(max_tokens=LONG, ignore_eos=True))
    await neighbour.__anext__()  # both seats taken: what comes next waits
    arrivals: list[float] = []

    async def read() -> None:
        async for _ in neighbour:
            arrivals.append(time.perf_counter())

    reader = asyncio.ensure_future(read())
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    queued = [asyncio.ensure_future(engine.generate([20 + i % 200, 5, 6], params)) for i in range(waiting)]
    scheduler = engine.core.scheduler
    while scheduler.num_waiting < waiting:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # the deltas made while the queue was built are read
    start = time.perf_counter()
    await asyncio.sleep(window)
    end = time.perf_counter()
    tokens = sum(start <= t < end for t in arrivals)
    if tokens < 2 or reader.done():
        raise RuntimeError(f"the neighbour made {tokens} tokens in {window} s (finished: {reader.done()})")
    cancel_start = time.perf_counter()
    for task in queued:
        task.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    cancel_s = time.perf_counter() - cancel_start
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await neighbour.aclose()
    await blocker.aclose()
    while scheduler.num_waiting or scheduler.num_running:
        await asyncio.sleep(0.01)
    return {"tpot_s": (end - start) / tokens, "cancel_s": cancel_s}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    path = tiny_model(Path(tempfile.mkdtemp()), max_position_embeddings=LONG + 16)
    engines = {policy: await AsyncEngine.load(path, dtype="float32", device="cpu", num_threads=1, max_num_seqs=2,
                                              max_model_len=LONG + 16, kv_cache_memory=64 * 2**20, scheduler=policy)
               for policy in args.policies}
    rounds: dict[str, dict[int, list[dict[str, float]]]] = {p: {n: [] for n in args.waiting} for p in args.policies}
    try:
        for engine in engines.values():
            await engine.start()
        for index in range(args.rounds):
            for policy, engine in engines.items():
                for n in args.waiting:
                    print(f"[waiting_queue] round {index + 1}/{args.rounds}: {policy}, {n} waiting", file=sys.stderr,
                          flush=True)
                    rounds[policy][n].append(await neighbour_tpot(engine, n, args.window))
    finally:
        for engine in engines.values():
            await engine.aclose()
    table = {policy: {str(n): {"tpot_ms": 1e3 * statistics.median(r["tpot_s"] for r in rs),
                               "cancel_s": statistics.median(r["cancel_s"] for r in rs)}
                      for n, rs in by_n.items()} for policy, by_n in rounds.items()}
    return {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "neighbour_tpot_ms": table, "rounds": rounds, "machine": machine_info()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, nargs="+", default=[0, 5000, 20000], help="queue lengths to measure")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--window", type=float, default=1.0, help="seconds the neighbour's tokens are counted")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    p.add_argument("--json", type=Path, help="write the record (commit, settings, every round) here")
    args = p.parse_args(argv)
    if not args.window > 0 or args.rounds < 1 or any(n < 0 for n in args.waiting):
        p.error("--window must be > 0, --rounds at least 1, --waiting at least 0")
    record = asyncio.run(run(args))
    for policy, by_n in record["neighbour_tpot_ms"].items():
        print(f"{policy:15s} " + "  ".join(f"{n} waiting: {v['tpot_ms']:.2f} ms/token (cancel {v['cancel_s']:.2f} s)"
                                           for n, v in by_n.items()))
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
