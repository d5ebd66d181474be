"""Load and chaos: seeded Poisson traffic with cancellations and injected faults, checked request by request.

For each arrival rate, ``--num-requests`` requests arrive as a seeded Poisson process:
prompts share a system prefix (prefix-cache hits), outputs have mixed lengths, some
ask for ``n = 2`` samples, priorities are mixed, a share is streamed, and
``--cancel-fraction`` of them are cancelled at a random point of their life (before,
during or after their prefill). With ``--fault-rate`` the forward pass raises on that
share of steps (and the sampler on half as many), which must fail only the requests of
those steps (``RequestFailedError``) while the engine keeps serving.

Every request that completes is checked against a solo run of the same prompt (greedy,
so its tokens must be identical whatever it was batched with). The report per rate:

- lost: requests that neither completed, were cancelled, nor failed with a typed error
  within ``--timeout`` (a hang); duplicated: a sample with more tokens than asked, or two
  finishes; wrong: completed with tokens other than the solo run's;
- blocks leaked (``kv_stats().used_blocks`` once all is done) and requests left in flight;
- event-loop lag (a 5 ms ticker's overshoot: p50, p99, max);
- TTFT, TPOT and end-to-end latency percentiles, throughput.

    python benchmarks/load.py --json benchmarks/results/load.json
    python benchmarks/load.py --tiny --num-requests 40 --rates 20 80   # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.errors import RequestFailedError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama built in a temporary directory")
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0], help="arrivals per second")
    p.add_argument("--num-requests", type=int, default=200, help="requests per rate")
    p.add_argument("--cancel-fraction", type=float, default=0.3)
    p.add_argument("--stream-fraction", type=float, default=0.3)
    p.add_argument("--fault-rate", type=float, default=0.005, help="share of steps whose forward pass raises")
    p.add_argument("--distinct-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--scheduler", default="aging-priority")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory", type=int, default=64 * 2**20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds after which a request counts as lost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


@dataclass
class Outcome:
    kind: str  # "completed", "cancelled", "failed", "lost", "error"
    prompt: int
    max_tokens: int
    n: int
    samples: list[list[int]] = field(default_factory=list)
    finishes: list[int] = field(default_factory=list)  # finishing pieces per sample
    ttft: float | None = None
    e2e: float | None = None
    detail: str = ""


def tiny_model(directory: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def build_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(40)]  # shared by every prompt: prefix-cache hits
    return [system + [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 30))]
            for _ in range(args.distinct_prompts)]


async def solo_references(engine: AsyncEngine, prompts: list[list[int]], lengths: list[int]) -> dict[tuple[int, int], list[int]]:
    """Each prompt alone, at the longest length (shorter outputs are prefixes of it, greedy)."""
    longest = max(lengths)
    refs = {}
    for i, prompt in enumerate(prompts):
        out = await engine.generate(prompt, SamplingParams(max_tokens=longest, ignore_eos=True))
        for n in lengths:
            refs[(i, n)] = out.token_ids[:n]
    return refs


def inject_faults(engine: AsyncEngine, rate: float, rng: random.Random) -> dict[str, int]:
    """Make the default generator's forward pass (and its sampler, at half the rate) raise now and then."""
    counts = {"forward": 0, "sampler": 0}
    core = engine.core
    run, sample = core.runner.run, core.sampler.__call__

    def faulty_run(inputs: Any) -> Any:
        if rng.random() < rate:
            counts["forward"] += 1
            raise RuntimeError("injected fault in the forward pass")
        return run(inputs)

    class FaultySampler:
        def __init__(self, real: Any) -> None:
            self.real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def __call__(self, *a: Any, **kw: Any) -> Any:
            if rng.random() < rate / 2:
                counts["sampler"] += 1
                raise RuntimeError("injected fault in the sampler")
            return sample(*a, **kw)

    real_sampler = core.sampler
    core.runner.run = faulty_run  # type: ignore[method-assign]
    core.sampler = FaultySampler(real_sampler)  # type: ignore[assignment]

    def restore() -> None:
        core.runner.run = run  # type: ignore[method-assign]
        core.sampler = real_sampler

    counts["_restore"] = restore  # type: ignore[assignment]
    return counts


async def one_request(engine: AsyncEngine, args: argparse.Namespace, prompt: list[int], pi: int, max_tokens: int,
                      n: int, priority: int, stream: bool, cancel_after: float | None) -> Outcome:
    outcome = Outcome("completed", pi, max_tokens, n, [[] for _ in range(n)], [0] * n)
    params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    start = time.perf_counter()

    async def run() -> None:
        if stream:
            async for d in engine.stream(prompt, params, priority=priority):
                if outcome.ttft is None:
                    outcome.ttft = time.perf_counter() - start
                outcome.samples[d.index].extend(d.token_ids)
                outcome.finishes[d.index] += d.finish_reason is not None
        else:
            out = await engine.generate(prompt, params, priority=priority)
            outcome.ttft = out.metrics.ttft
            for c in out.outputs:
                outcome.samples[c.index] = list(c.token_ids)
                outcome.finishes[c.index] = 1
                if c.finish_reason != "length":
                    outcome.kind, outcome.detail = "error", f"finish_reason {c.finish_reason!r}"
        outcome.e2e = time.perf_counter() - start

    task = asyncio.create_task(run())
    try:
        if cancel_after is not None:
            done, _ = await asyncio.wait({task}, timeout=cancel_after)
            if not done:
                task.cancel()
                outcome.kind = "cancelled"
        await asyncio.wait_for(asyncio.shield(task), args.timeout)
    except asyncio.CancelledError:
        if outcome.kind != "cancelled":
            raise
    except RequestFailedError as exc:
        outcome.kind, outcome.detail = "failed", repr(exc.__cause__)
    except asyncio.TimeoutError:
        outcome.kind, outcome.detail = "lost", "no end within --timeout"
        task.cancel()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        outcome.kind, outcome.detail = "error", repr(exc)
    return outcome


async def loop_lag(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append(time.perf_counter() - t0 - 0.005)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def judge(outcomes: list[Outcome], refs: dict[tuple[int, int], list[int]]) -> dict[str, Any]:
    counts = {"completed": 0, "cancelled": 0, "failed": 0, "lost": 0, "error": 0, "wrong": 0, "duplicated": 0}
    examples: list[str] = []
    for o in outcomes:
        counts[o.kind] += 1
        expected = refs[(o.prompt, o.max_tokens)]
        for i, tokens in enumerate(o.samples):
            if len(tokens) > o.max_tokens or o.finishes[i] > 1:
                counts["duplicated"] += 1
            elif o.kind == "completed" and tokens != expected:
                counts["wrong"] += 1
                examples.append(f"prompt {o.prompt} sample {i}: {tokens[:8]} != {expected[:8]}")
            elif o.kind in ("cancelled", "failed") and tokens != expected[: len(tokens)]:
                counts["wrong"] += 1  # even a partial output must be the request's own
                examples.append(f"partial prompt {o.prompt} sample {i}: {tokens[:8]} !~ {expected[:8]}")
        if o.kind == "error":
            examples.append(f"error: {o.detail}")
    return {"counts": counts, "examples": examples[:5]}


async def run_rate(engine: AsyncEngine, args: argparse.Namespace, rate: float, prompts: list[list[int]],
                   refs: dict[tuple[int, int], list[int]], rng: random.Random) -> dict[str, Any]:
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(loop_lag(stop, lags))
    tasks = []
    t0 = time.perf_counter()
    for _ in range(args.num_requests):
        await asyncio.sleep(rng.expovariate(rate))
        pi = rng.randrange(len(prompts))
        max_tokens = rng.choice(args.max_tokens)
        life = args.seconds_per_token * (max_tokens + 4)  # about a request's life at this load
        cancel_after = rng.uniform(0.0, 1.5 * life) if rng.random() < args.cancel_fraction else None
        tasks.append(asyncio.create_task(one_request(
            engine, args, prompts[pi], pi, max_tokens, rng.choice([1, 1, 1, 2]), rng.choice([-1, 0, 0, 1]),
            rng.random() < args.stream_fraction, cancel_after)))
    outcomes = await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    stop.set()
    await ticker
    for _ in range(200):  # the last aborts are confirmed at the next step boundary
        if engine.kv_stats().used_blocks == 0 and engine.num_unfinished_requests == 0:
            break
        await asyncio.sleep(0.01)
    verdict = judge(outcomes, refs)
    done = [o for o in outcomes if o.kind == "completed"]
    tokens = sum(len(t) for o in done for t in o.samples)
    tpot = [(o.e2e - o.ttft) / max(1, o.max_tokens - 1) for o in done if o.e2e is not None and o.ttft is not None]
    return {
        "rate": rate,
        **verdict,
        "blocks_leaked": engine.kv_stats().used_blocks,
        "requests_left": engine.num_unfinished_requests,
        "wall_s": wall,
        "completed_tokens_per_s": tokens / wall,
        "loop_lag_ms": {k: (v * 1e3 if v is not None else None)
                        for k, v in (("p50", pct(lags, 0.5)), ("p99", pct(lags, 0.99)), ("max", max(lags, default=None)))},
        "ttft_s": {"p50": pct([o.ttft for o in done if o.ttft is not None], 0.5),
                   "p99": pct([o.ttft for o in done if o.ttft is not None], 0.99)},
        "tpot_s": {"p50": pct(tpot, 0.5), "p99": pct(tpot, 0.99)},
        "e2e_s": {"p50": pct([o.e2e for o in done if o.e2e is not None], 0.5),
                  "p99": pct([o.e2e for o in done if o.e2e is not None], 0.99)},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": "float32", "device": "cpu", "scheduler": args.scheduler,
                               "max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory,
                               "max_model_len": 512, "max_consecutive_step_failures": 3}
    if args.threads:
        options["num_threads"] = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp)) if args.tiny else args.model
        engine = await asyncio.to_thread(AsyncEngine.from_pretrained, model, **options)
        rng = random.Random(args.seed)
        prompts = build_prompts(args, engine.model_config.vocab_size)
        results = []
        async with engine:
            t0 = time.perf_counter()
            refs = await solo_references(engine, prompts, args.max_tokens)
            # Cancellation points are drawn over a request's life, measured here (solo, so a floor).
            args.seconds_per_token = 4 * (time.perf_counter() - t0) / (len(prompts) * max(args.max_tokens))
            faults = inject_faults(engine, args.fault_rate, rng) if args.fault_rate > 0 else {}
            for rate in args.rates:
                result = await run_rate(engine, args, rate, prompts, refs, rng)
                result["faults_injected_so_far"] = {k: v for k, v in faults.items() if k != "_restore"}
                results.append(result)
                c = result["counts"]
                print(f"rate {rate:g}/s: {c['completed']} completed, {c['cancelled']} cancelled, {c['failed']} failed "
                      f"by injected faults, lost {c['lost']}, wrong {c['wrong']}, duplicated {c['duplicated']}, "
                      f"errors {c['error']}, blocks leaked {result['blocks_leaked']}, "
                      f"loop lag p99 {result['loop_lag_ms']['p99']:.1f} ms, "
                      f"TTFT p50 {result['ttft_s']['p50'] or float('nan'):.3f} s, "
                      f"{result['completed_tokens_per_s']:.1f} tok/s", flush=True)
                for example in result["examples"]:
                    print("  ", example)
            if "_restore" in faults:
                faults["_restore"]()  # the check that it still serves runs without injected faults
            alive = (await engine.generate(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))).token_ids
    return {"model": "tiny random Llama" if args.tiny else str(args.model or "SmolLM2-135M-Instruct"),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": results, "serves_after": alive == refs[(0, 8)] if (0, 8) in refs else None}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = asyncio.run(run(args))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))
    bad = any(r["counts"]["lost"] or r["counts"]["wrong"] or r["counts"]["duplicated"] or r["counts"]["error"]
              or r["blocks_leaked"] or r["requests_left"] for r in record["results"])
    return 1 if bad or record["serves_after"] is False else 0


if __name__ == "__main__":
    raise SystemExit(main())
