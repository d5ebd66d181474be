"""Throughput of schema-constrained requests against the same requests unconstrained, in one run.

One engine (the default model, or ``--model``), ``--num-requests`` chat requests at t=0, each asking for a
JSON record of a person (name, age, city) from a short text, ``--max-tokens`` new tokens at most, greedy:
once with ``SamplingParams(structured=StructuredOutput.json_schema(...))`` and once without, in alternating
order for ``--rounds`` rounds. Reports output tokens per second of each, their ratio per round and its
median, the engine's per-step mask time (``step_stats().mask_seconds`` over the constrained run's steps)
and how many constrained replies parse as JSON. The grammar is compiled once before the timing (a first
structured request builds the vocabulary and compiles it; later ones hit the cache).

    python benchmarks/structured.py --json benchmarks/results/structured.json
    python benchmarks/structured.py --num-requests 2 --max-tokens 8 --rounds 1     # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

from common import git_commit, machine_info, resolve_model_path, write_record

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "city": {"type": "string", "maxLength": 32}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PEOPLE = ("Ana is 34 and lives in Lisbon.", "Tom, 51, moved to Leeds last year.", "Mei (27) works in Taipei.",
          "In Oslo lives Ingrid, who is 45.", "Carlos turned 60 in Bogota.", "Priya, aged 22, studies in Pune.")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncinfer import AsyncEngine, SamplingParams, StructuredOutput

    engine = await AsyncEngine.load(str(resolve_model_path(args.model)), num_threads=args.threads,
                                    max_num_seqs=args.num_requests, max_model_len=512)
    spec = StructuredOutput.json_schema(SCHEMA)
    messages = [[{"role": "user", "content": f"Give the person in this text as JSON (name, age, city): "
                                            f"{PEOPLE[i % len(PEOPLE)]}"}] for i in range(args.num_requests)]

    async def batch(structured: bool) -> dict[str, Any]:
        params = SamplingParams(max_tokens=args.max_tokens, structured=spec if structured else None)
        before = engine.step_stats()
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(m, params) for m in messages))
        wall = time.perf_counter() - start
        after = engine.step_stats()
        tokens = sum(len(o.token_ids) for o in outs)
        steps = after.steps - before.steps
        mask = after.mask_seconds - before.mask_seconds
        parsed = 0
        for o in outs:
            try:
                json.loads(o.text)
                parsed += 1
            except ValueError:
                pass
        return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
                "mask_seconds": mask, "mask_ms_per_step": 1e3 * mask / steps if steps else 0.0,
                "replies_that_parse": parsed}

    async with engine:
        await engine.generate(messages[0], SamplingParams(max_tokens=4, structured=spec))  # vocabulary + compile
        await engine.generate(messages[0], SamplingParams(max_tokens=4))
        rounds = []
        for index in range(args.rounds):
            order = (True, False) if index % 2 == 0 else (False, True)
            got = {("constrained" if s else "unconstrained"): await batch(s) for s in order}
            got["order"] = ["constrained" if s else "unconstrained" for s in order]
            got["ratio"] = got["constrained"]["tokens_per_s"] / got["unconstrained"]["tokens_per_s"]
            rounds.append(got)
            print(f"round {index + 1}: constrained {got['constrained']['tokens_per_s']:.1f} tok/s "
                  f"({got['constrained']['mask_ms_per_step']:.2f} ms of masks a step), unconstrained "
                  f"{got['unconstrained']['tokens_per_s']:.1f}; ratio {got['ratio']:.3f}", flush=True)
    return {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the default model)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for name in ("num_requests", "max_tokens", "rounds", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    record: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "commit": git_commit(), "settings": {k: str(v) for k, v in vars(args).items()},
                              "load_average_start": os.getloadavg()}
    record.update(asyncio.run(run(args)))
    record.update({"machine": machine_info(), "load_average_end": os.getloadavg()})
    print(f"constrained / unconstrained throughput, median of {len(record['rounds'])} rounds: "
          f"{record['median_ratio']:.3f}x")
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
