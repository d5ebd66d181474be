"""Isolation under hostile neighbours: what one request's own work costs the others' per-token latency.

A neighbour streams ``--tokens`` greedy tokens while one companion runs beside it for all of
its life. The neighbour's per-token latency (the median gap between its deltas) is measured
with each companion, in interleaved rounds:

- ``alone``: no companion;
- ``plain``: a companion with the same prompt and no stop strings (what one more row costs);
- ``stops``: the same companion with the longest stop list the limits allow
  (``MAX_STOP_STRINGS`` strings of ``MAX_STOP_CHARS`` characters together, each a live
  candidate that never completes) and ``MAX_STOP_TOKEN_IDS`` stop token ids, masked at every
  step (``min_tokens = max_tokens``);
- ``chats`` (a model with a chat template): beside ``plain``, a caller sending chats of
  ``MAX_CHAT_MESSAGES`` empty messages (templated off the loop, then refused for length) and
  of 100,000 (refused before any work), back to back;
- ``stop_flood``: beside ``plain``, a caller sending requests of one token, 16 at a time, back to back, each
  with a stop list of its own at both limits (a new automaton to build for every request, on the engine
  thread: docs/reliability.md's limits table says what it costs).

Reported per case: the median TPOT over rounds, its ratio to ``plain`` (the fraction a request
at the limits adds beyond an ordinary one), the neighbour's whole stream time (its first delta to its last;
what a flood shows, since it adds to some gaps), and the event loop's lag (a 5 ms ticker's worst
overshoot). ``--tiny`` runs a tiny random Llama whose core is given a tokenizer of one
character per id (it has none), so stop strings run; it has no chat template.

    python benchmarks/isolation.py --json benchmarks/results/isolation.json
    python benchmarks/isolation.py --tiny --rounds 2 --tokens 32      # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import git_commit, machine_info

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from asyncinfer.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama built in a temporary directory")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="tokens the neighbour streams")
    p.add_argument("--threads", type=int, default=None, help="torch threads (num_threads)")
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


class CharTokenizer:
    """For ``--tiny``: token ``i`` decodes to a character of its own."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def hostile_stops(sample: str, variant: int = 0) -> list[str]:
    """The longest stop list the limits allow; each string starts like ``sample`` (a live candidate
    at every token) and ends in a character no model writes, so none ever completes. Each ``variant``
    is a list of its own (its own automaton)."""
    length = MAX_STOP_CHARS // MAX_STOP_STRINGS
    head = (sample * length)[: length - 3]
    tag = chr(0xE000 + 4096 + variant % 2048)
    return [head + tag + chr(0xE000 + i // 64) + chr(0xE000 + i % 64) for i in range(MAX_STOP_STRINGS)]


async def neighbour_stream(engine: AsyncEngine, prompt: Any, tokens: int) -> tuple[float, float]:
    """The median gap (seconds) between the neighbour's deltas, and its first delta to its last."""
    stamps = []
    async for _ in engine.stream(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return statistics.median(gaps), stamps[-1] - stamps[0]


async def stop_flood(engine: AsyncEngine, stop: asyncio.Event, prompt: Any, sample: str) -> int:
    """Send one-token requests, 16 at a time, each with a stop list of its own at the limits, until ``stop``;
    returns how many were sent."""
    sent = 0
    while not stop.is_set():
        batch = [SamplingParams(max_tokens=1, stop=hostile_stops(sample, sent + i)) for i in range(16)]
        await asyncio.gather(*(engine.generate(prompt, params) for params in batch))
        sent += len(batch)
    return sent


async def chat_flood(engine: AsyncEngine, stop: asyncio.Event) -> int:
    """Send huge chats back to back until ``stop``; returns how many were refused."""
    refused = 0
    empty = {"role": "user", "content": ""}
    while not stop.is_set():
        for count in (MAX_CHAT_MESSAGES, 100_000):
            try:
                await engine.generate([empty] * count, SamplingParams(max_tokens=1))
            except InvalidParameterError:
                refused += 1
    return refused


async def one_case(engine: AsyncEngine, case: str, prompt: Any, companion: Any, tokens: int,
                   stops: list[str]) -> dict[str, float]:
    lag = 0.0
    ticking = True

    async def ticker() -> None:
        nonlocal lag
        while ticking:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lag = max(lag, time.perf_counter() - t - 0.005)

    tick = asyncio.create_task(ticker())
    side: list[asyncio.Task[Any]] = []
    stop = asyncio.Event()
    if case != "alone":
        params = SamplingParams(max_tokens=10 * tokens, ignore_eos=True)
        if case == "stops":  # min_tokens: the stop ids are masked at every step, never stop it
            params = params.with_updates(stop=stops, min_tokens=params.max_tokens,
                                         stop_token_ids=[i % engine.model_config.vocab_size
                                                         for i in range(MAX_STOP_TOKEN_IDS)])
        side.append(asyncio.create_task(engine.generate(companion, params)))
        await asyncio.sleep(0.05)  # it runs before the neighbour starts, and after it ends
    if case == "chats":
        side.append(asyncio.create_task(chat_flood(engine, stop)))
    if case == "stop_flood":
        side.append(asyncio.create_task(stop_flood(engine, stop, companion, stops[0][:4])))
    tpot, stream_s = await neighbour_stream(engine, prompt, tokens)
    stop.set()
    for task in side:
        task.cancel()
    await asyncio.gather(*side, return_exceptions=True)
    ticking = False
    await tick
    return {"tpot_s": tpot, "stream_s": stream_s, "loop_lag_s": lag}


async def run(args: argparse.Namespace, argv_used: list[str] | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {"max_model_len": 1024}
    if args.threads:
        options["num_threads"] = args.threads
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.helpers import tiny_hf_model

        model = tiny_hf_model("llama", 0, vocab_size=320, max_position_embeddings=1024)
        path: Any = tempfile.mkdtemp()
        model.save_pretrained(path, safe_serialization=True)
        options.update(dtype="float32", kv_cache_memory=16 * 2**20)
    else:
        path = args.model
    engine = await AsyncEngine.load(path, **options)
    if args.tiny:
        engine.core.tokenizer = CharTokenizer()
        prompt: Any = [(13 * j) % 300 + 3 for j in range(20)]
        companion: Any = [(29 * j) % 300 + 7 for j in range(20)]
        sample = CharTokenizer().decode([5, 6, 7])
        cases = ["alone", "plain", "stops", "stop_flood"]
    else:
        prompt = "Write a long story about a lighthouse keeper."
        companion = "Write a long story about a sailor."
        sample = " the"
        cases = ["alone", "plain", "stops", "chats", "stop_flood"]
    stops = hostile_stops(sample)
    rounds: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    async with engine:
        await neighbour_stream(engine, prompt, 4)  # warm
        for _ in range(args.rounds):
            for case in cases:
                rounds[case].append(await one_case(engine, case, prompt, companion, args.tokens, stops))
    median = {case: statistics.median(r["tpot_s"] for r in rs) for case, rs in rounds.items()}
    stream = {case: statistics.median(r["stream_s"] for r in rs) for case, rs in rounds.items()}
    return {
        "command": " ".join(["python", "benchmarks/isolation.py", *(argv_used or [])]),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_end": list(os.getloadavg()),
        "machine": machine_info(),
        "model": "tiny" if args.tiny else str(args.model or "SmolLM2-135M-Instruct"),
        "rounds": rounds,
        "median_tpot_s": median,
        "over_plain": {case: median[case] / median["plain"] for case in cases},
        "median_stream_s": stream,
        "max_loop_lag_s": {case: max(r["loop_lag_s"] for r in rs) for case, rs in rounds.items()},
        "limits": {"MAX_STOP_STRINGS": MAX_STOP_STRINGS, "MAX_STOP_CHARS": MAX_STOP_CHARS,
                   "MAX_STOP_TOKEN_IDS": MAX_STOP_TOKEN_IDS, "MAX_CHAT_MESSAGES": MAX_CHAT_MESSAGES},
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = asyncio.run(run(args, argv))
    for case, tpot in result["median_tpot_s"].items():
        print(f"{case:10s} neighbour TPOT {tpot * 1e3:8.2f} ms  x{result['over_plain'][case]:.3f} of plain  "
              f"stream {result['median_stream_s'][case]:.2f} s  "
              f"loop lag max {result['max_loop_lag_s'][case] * 1e3:.1f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
