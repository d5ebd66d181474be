"""What ``engine.metrics`` costs: the same workload on two engines, metrics on and off, alternating.

Two engines of the same model live in one process: one with ``enable_metrics=True``
(the default: the core's step hook, the stream table's observer, the refusal and
swap counters) and one with ``enable_metrics=False`` (no hook is installed at all).
Each round runs the same greedy workload (``--requests`` prompts of mixed length,
``--max-tokens`` tokens each, all submitted at once) on one engine, then on the other,
in alternating order, with the prefix cache reset before every run. The figure is the
median over rounds of the wall time per engine step, on and off; the machine is
shared, so medians of alternating runs, not single runs. A snapshot and a Prometheus
exposition are rendered after every metrics-on run (as a scrape would), outside its time.

It also times the two pieces directly, which a noisy shared machine cannot blur: the step
hook (the engine thread's only added work per step) and the stream table's observer (the
event loop's added work per output batch, which holds the GIL while it runs).

    python benchmarks/metrics_overhead.py --json benchmarks/results/metrics_overhead.json
    python benchmarks/metrics_overhead.py --tiny --rounds 9     # a tiny random model: the worst case
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.metrics.exposition import exposition

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import tiny_model


async def run(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, scrape: bool) -> dict[str, Any]:
    engine.reset_prefix_cache()
    await asyncio.sleep(0.01)  # the reset reaches the engine thread before the requests
    steps_before = engine.step_stats().steps
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    wall = time.perf_counter() - start
    steps = engine.step_stats().steps - steps_before
    if scrape:  # as a scrape would, between runs (a scrape every 15 s is not part of a step's cost)
        engine.metrics.snapshot()
        exposition(engine)
    return {"wall_s": wall, "steps": steps, "step_ms": 1000 * wall / steps, "tokens": [o.token_ids for o in outs]}


class TimedObserver:
    """The stream table's observer (the metrics), timed: the event loop's added work per output batch."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[float] = []

    def outputs(self, outputs: Any) -> None:
        start = time.perf_counter()
        self.inner.outputs(outputs)
        self.calls.append(time.perf_counter() - start)

    def failed(self) -> None:
        self.inner.failed()


def time_hooks(engine: AsyncEngine) -> tuple[list[float], TimedObserver]:
    """Wrap the default core's step hook and the stream table's observer to time them."""
    core = engine.core
    hook = core.on_step
    assert hook is not None
    calls: list[float] = []

    def timed(*args: Any) -> None:
        start = time.perf_counter()
        hook(*args)
        calls.append(time.perf_counter() - start)

    core.on_step = timed
    observer = TimedObserver(engine.metrics)
    engine._streams.observer = observer  # the benchmark's peek; the engine sets it once, in its constructor
    return calls, observer


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model
    if args.tiny:
        model = tiny_model(Path(tempfile.mkdtemp(prefix="asyncinfer-tiny-")))
    options = {"dtype": "float32", "device": "cpu", "max_model_len": args.max_model_len, "memory_bandwidth": 1e10,
               "kv_cache_memory": args.kv_cache_memory, "num_threads": args.threads}
    on = await AsyncEngine.load(model, **options, enable_metrics=True)  # off the loop (from_pretrained warned)
    off = await AsyncEngine.load(model, **options, enable_metrics=False)
    rng = random.Random(args.seed)
    vocab = on.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, args.max_prompt))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    async with on, off:
        await run(on, prompts, params, True)  # warm both (allocator, caches) before timing
        await run(off, prompts, params, False)
        for r in range(args.rounds):
            order = (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))
            for name, engine in order:
                results[name].append(await run(engine, prompts, params, name == "on"))
            print(f"round {r + 1}/{args.rounds}: on {results['on'][-1]['step_ms']:.3f} ms/step, "
                  f"off {results['off'][-1]['step_ms']:.3f} ms/step", file=sys.stderr)
        assert all(a["tokens"] == b["tokens"] for a, b in zip(results["on"], results["off"])), "outputs differ"
        hook_calls, observer = time_hooks(on)
        hooked = await run(on, prompts, params, True)
    hook_us = [1e6 * t for t in hook_calls]
    observer_us = [1e6 * t for t in observer.calls]
    med = {k: statistics.median(x["step_ms"] for x in v) for k, v in results.items()}
    return {
        "command": "python " + " ".join(sys.argv),
        "model": ("tiny random llama (2 layers, hidden 64)" if args.tiny
                  else str(model or "SmolLM2-135M-Instruct (default)")),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "workload": {"requests": args.requests, "max_tokens": args.max_tokens, "steps_per_run": hooked["steps"]},
        "rounds": args.rounds,
        "step_ms_on": [x["step_ms"] for x in results["on"]],
        "step_ms_off": [x["step_ms"] for x in results["off"]],
        "median_step_ms_on": med["on"],
        "median_step_ms_off": med["off"],
        "overhead_of_median_step": (med["on"] - med["off"]) / med["off"],
        "hook_us_median": statistics.median(hook_us),
        "hook_us_p99": sorted(hook_us)[int(0.99 * (len(hook_us) - 1))],
        "hook_share_of_median_step": statistics.median(hook_us) / 1000 / med["on"],
        "observer_us_median": statistics.median(observer_us),
        "observer_share_of_median_step": statistics.median(observer_us) / 1000 / med["on"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a tiny random model instead (worst case: ms steps)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=64 * 1024**2)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    print(f"median step: metrics on {result['median_step_ms_on']:.3f} ms, off {result['median_step_ms_off']:.3f} ms "
          f"({100 * result['overhead_of_median_step']:+.2f}%); hook {result['hook_us_median']:.1f} us median "
          f"({100 * result['hook_share_of_median_step']:.3f}% of a step), loop-side observer "
          f"{result['observer_us_median']:.1f} us per output batch")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
