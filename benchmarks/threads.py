"""Another thread's OpenMP team against the engine's speed: why loading runs on a thread of its own.

torch's OpenMP runtime (libgomp) keeps a team of worker threads for every thread that ran
a parallel torch op, until that thread ends. With more such threads than CPUs its workers
sleep between parallel regions, and each region waits for a wake-up. This script runs one
engine (the default model, its default format) and measures, alternating in one process:

- ``clean``: no thread but the engine's has run torch work (what ``from_pretrained`` leaves
  now that loading runs on a thread that ends with it, ``asyncinfer.on_own_thread``);
- ``other_team``: a thread that stays alive has run one parallel torch op (what loading on the
  caller's thread left behind before, and what an application's own torch work on its main
  thread still does).

Figures: single-request decode tok/s (one request, ``--decode-tokens`` new tokens, the
first token's time taken off: ``(n - 1) / (T(n) - T(1))``) and batched tok/s
(``--batch`` requests of ``--batch-tokens`` tokens at once); medians over ``--rounds``.

    python benchmarks/threads.py --json benchmarks/results/threads.json
    python benchmarks/threads.py --rounds 1 --decode-tokens 8 --batch 2 --batch-tokens 4   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import engine_decode_rate, machine_info


class OtherTeam:
    """A thread that runs one parallel torch op, then stays alive until :meth:`release`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="other-team", daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        import torch

        x = torch.ones(1 << 20)
        torch.add(x, x, out=x)  # large enough for torch to split it across its threads
        self._ready.set()
        self._done.wait()

    def release(self) -> None:
        self._done.set()
        self._thread.join()


async def batch_rate(engine: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tok/s of ``len(prompts)`` requests sent at once."""
    from asyncinfer import SamplingParams

    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                                  for p in prompts))
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / wall


async def measure(engine: Any, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    tok = engine.tokenizer
    prompt = tok.encode("Write a short story about a lighthouse keeper and a storm.")
    prompts = [tok.encode(f"Question {i}: name a city and say one thing about it.") for i in range(args.batch)]
    figures: dict[str, dict[str, list[float]]] = {c: {"decode": [], "batch": []} for c in ("clean", "other_team")}
    async with engine:
        await batch_rate(engine, prompts[:2], 4)  # warm-up
        for r in range(args.rounds):
            for case in ("clean", "other_team") if r % 2 == 0 else ("other_team", "clean"):
                other = OtherTeam() if case == "other_team" else None
                try:
                    rate = await engine_decode_rate(engine, prompt, args.decode_tokens, warm_up=False)
                    figures[case]["decode"].append(rate["decode_tokens_per_s"])
                    figures[case]["batch"].append(await batch_rate(engine, prompts, args.batch_tokens))
                finally:
                    if other is not None:
                        other.release()
                print(f"round {r + 1} {case:<10} decode {figures[case]['decode'][-1]:6.1f} tok/s   "
                      f"batch of {args.batch} {figures[case]['batch'][-1]:6.1f} tok/s", flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model for from_pretrained (default: the engine's default model)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (median reported)")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens of the one-request decode test")
    p.add_argument("--batch", type=int, default=16, help="requests sent at once in the batched test")
    p.add_argument("--batch-tokens", type=int, default=64, help="new tokens of each batched request")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)

    from asyncinfer import AsyncEngine

    engine = AsyncEngine.from_pretrained(args.model, max_num_seqs=max(args.batch, 1), max_model_len=256)
    figures = asyncio.run(measure(engine, args))
    medians = {case: {k: statistics.median(v) for k, v in f.items()} for case, f in figures.items()}
    ratios = {k: medians["clean"][k] / medians["other_team"][k] for k in ("decode", "batch")}
    print(f"medians: clean decode {medians['clean']['decode']:.1f} tok/s, batch {medians['clean']['batch']:.1f}; "
          f"other team decode {medians['other_team']['decode']:.1f}, batch {medians['other_team']['batch']:.1f}; "
          f"clean / other team: decode {ratios['decode']:.2f}x, batch {ratios['batch']:.2f}x")
    if args.json:
        record = {"command": "python benchmarks/threads.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "machine": machine_info(), "model": args.model or "default",
                  "weight_format": engine.config.quantization or str(engine.config.dtype),
                  "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "rounds": figures, "medians": medians, "clean_over_other_team": ratios}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
