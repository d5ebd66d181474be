"""What sampling penalties add to a decode step, as a request's output grows.

The sampler is called as the engine calls it, once per step, on ``--rows`` rows of ``--vocab`` logits, each row a
request with repetition, frequency and presence penalties whose output is ``L`` tokens long and grows by one
token a step (random tokens: the worst case, nearly every token distinct). Printed per output length: the median
milliseconds of a step with those rows, and of the same step with the rows greedy and unpenalized (``plain``); the
difference is what the penalized requests add to every request's step.

    python benchmarks/penalties.py --json benchmarks/results/penalties.json
    python benchmarks/penalties.py --lengths 0 1000 --steps 5         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import git_commit, machine_info

from asyncinfer.sampler import Sampler, SamplingState
from asyncinfer.sampling_params import SamplingParams


def step_ms(sampler: Sampler, states: list[SamplingState], vocab: int, steps: int, rng: random.Random) -> float:
    """Median milliseconds of ``steps`` sampler calls, each output growing by one token after its step."""
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(len(states), vocab, generator=gen)
        start = time.perf_counter()
        out = sampler(logits, states)
        times.append(time.perf_counter() - start)
        for s, t in zip(states, out.token_ids):
            s.output_token_ids.append(rng.randrange(vocab) if s.params.has_penalties else t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152, help="logits per row (default: the default model's 49,152)")
    ap.add_argument("--rows", type=int, default=8, help="penalized requests in the step (default 8)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[0, 1000, 8000, 32000], help="output lengths")
    ap.add_argument("--steps", type=int, default=30, help="steps timed per length (default 30)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    sampler = Sampler(args.vocab, torch.device("cpu"))
    rows: list[dict[str, Any]] = []
    print(f"{args.rows} rows of {args.vocab} logits, {args.threads} thread(s); ms per step (median of {args.steps})")
    print(f"{'output tokens':>14} {'penalized':>10} {'plain':>8}")
    for length in args.lengths:
        penalized = [SamplingState(SamplingParams(max_tokens=1, repetition_penalty=1.1, frequency_penalty=0.5,
                                                  presence_penalty=0.1, seed=i), list(range(100, 200)),
                                   [rng.randrange(args.vocab) for _ in range(length)]) for i in range(args.rows)]
        plain = [SamplingState(SamplingParams(max_tokens=1), list(range(100, 200)), []) for _ in range(args.rows)]
        step_ms(sampler, penalized, args.vocab, 2, rng)  # warm up, and the first step counts the history once
        row = {"output_tokens": length, "penalized_ms": step_ms(sampler, penalized, args.vocab, args.steps, rng),
               "plain_ms": step_ms(sampler, plain, args.vocab, args.steps, rng)}
        rows.append(row)
        print(f"{length:>14} {row['penalized_ms']:>10.2f} {row['plain_ms']:>8.2f}")
    if args.json:
        record = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": git_commit(),
                  "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "rows": rows, "machine": machine_info()}
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
