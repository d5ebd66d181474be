"""Does the policy lab predict the real engine? One trace, several policies, both ways.

    python benchmarks/scheduler_lab.py                      # SmolLM2-135M on CPU: ~1 min per policy
    python benchmarks/scheduler_lab.py --requests 12 --policies fifo,pd-split --json out.json

For each policy the script replays the same trace through the real engine
(requests submitted at their arrival times with ``engine.stream``, token times
taken as the deltas arrive) and through :func:`asyncinfer.lab.simulate` with the
same limits, the same number of KV blocks and the cost model (the shipped one,
or ``--cost-model``, or ``--calibrate`` to fit one on this model first). It
prints both tables, each metric's ordering of the policies from both, Kendall's
tau between the orderings, and the relative gap of every simulated figure.

The real engine runs with ``--threads`` torch threads (default 1, as the shipped
cost model was calibrated): on a shared 2-core machine two threads that other
processes keep preempting are several times slower, and unpredictably so.
The real side has no "first scheduled" time, so its wait column is TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from typing import Any

from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.errors import ConfigurationError, InvalidParameterError, ModelLoadError
from asyncinfer.lab import (
    RequestRecord,
    Slo,
    StepCostModel,
    TraceRequest,
    format_table,
    load_cost_model,
    simulate,
    summarize,
    synthetic_trace,
)
from asyncinfer.schedulers import SchedulerConfig, builtin_schedulers

#: Below this spread between the policies' real figures, an ordering is mostly noise.
SPREAD = 0.10

#: Step-cost scales of the sensitivity check: is the lab's best policy the same if every step costs 15% less or more?
SCALES = (0.85, 1.15)

#: (name, lower is better) of the figures compared.
METRICS = (
    ("e2e_mean", True),
    ("e2e_p50", True),
    ("e2e_p99", True),
    ("ttft_p50", True),
    ("ttft_p99", True),
    ("tpot_p50", True),
    ("urgent_ttft_p50", True),
    ("itl_max", True),
    ("throughput", False),
)


def default_trace(num_requests: int, rate: float, seed: int) -> list[TraceRequest]:
    """A burst of mixed lengths (30% long prompts) and two priority classes, sized for a CPU run."""
    return synthetic_trace(num_requests, rate=rate, seed=seed, short_prompt=(16, 96), long_prompt=(400, 800),
                           long_fraction=0.3, output=(8, 64), priorities=(0, 4))


async def replay(engine: AsyncEngine, trace: list[TraceRequest], seed: int = 0) -> list[RequestRecord]:
    """Submit every request at its arrival offset; record token times as deltas arrive."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    prompts = {t.id: [rng.randrange(100, vocab) for _ in range(t.prompt_len)] for t in trace}
    records: dict[str, RequestRecord] = {}
    start = time.time()

    async def one(t: TraceRequest) -> None:
        await asyncio.sleep(max(0.0, start + t.arrival - time.time()))
        record = RequestRecord(t.id, time.time() - start, t.prompt_len, t.output_len, t.priority)
        records[t.id] = record
        params = SamplingParams(max_tokens=t.output_len, ignore_eos=True)
        async for delta in engine.stream(prompts[t.id], params, request_id=t.id, priority=t.priority):
            now = time.time() - start
            record.token_times.extend([now] * len(delta.token_ids))
            if delta.finish_reason is not None:
                record.finish = now

    await asyncio.gather(*(one(t) for t in trace))
    return [records[t.id] for t in trace]


async def run_real(model: str | None, policy: str, trace: list[TraceRequest], engine_options: dict[str, Any]
                   ) -> tuple[list[RequestRecord], int, int]:
    """The replay's records, the number of KV blocks, and the preemptions the engine counted."""
    engine = await AsyncEngine.load(model, scheduler=policy, **engine_options)  # off the loop (from_pretrained warned)
    async with engine:
        await engine.generate([100, 101, 102], SamplingParams(max_tokens=2))  # warm-up, outside the clock
        records = await replay(engine, trace)
    return records, engine.memory_plan.num_blocks, engine.step_stats().preemptions


def kendall_tau(a: list[str], b: list[str]) -> float:
    """Rank agreement of two orderings of the same names: 1 identical, -1 reversed."""
    pos_a = {n: i for i, n in enumerate(a)}
    pos_b = {n: i for i, n in enumerate(b)}
    pairs = [(x, y) for i, x in enumerate(a) for y in a[i + 1:]]
    if not pairs:
        return 1.0
    score = sum(1 if (pos_a[x] - pos_a[y]) * (pos_b[x] - pos_b[y]) > 0 else -1 for x, y in pairs)
    return score / len(pairs)


def _order(summaries: dict[str, Any], metric: str, lower_better: bool) -> list[str]:
    """The policies, best first on ``metric``."""
    return sorted(summaries, key=lambda p: getattr(summaries[p], metric), reverse=not lower_better)


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Orderings, tau and relative gaps per metric (summaries keyed by policy).

    ``spread`` is how far apart the policies are on the real engine, (max - min) / min:
    where it is small the real ordering is within run-to-run noise and says little.
    """
    out: dict[str, Any] = {}
    for metric, lower_better in METRICS:
        r, s = _order(real, metric, lower_better), _order(sim, metric, lower_better)
        values = [getattr(v, metric) for v in real.values()]
        spread = (max(values) - min(values)) / min(values) if min(values) > 0 else float("inf")
        gaps = {p: (getattr(sim[p], metric) - getattr(real[p], metric)) / getattr(real[p], metric)
                for p in real if getattr(real[p], metric)}
        out[metric] = {"real": r, "sim": s, "tau": kendall_tau(r, s), "best_agrees": r[0] == s[0],
                       "spread": spread, "gap": gaps}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--policies", default=",".join(builtin_schedulers()))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trace", default=None, help="a JSONL trace instead of the synthetic one")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", type=int, default=96 * 2**20)
    p.add_argument("--cost-model", default=None, help="cost model JSON (default: the shipped one)")
    p.add_argument("--calibrate", action="store_true", help="fit a cost model on --model first and use it")
    p.add_argument("--slo-ttft", type=float, default=5.0)
    p.add_argument("--slo-tpot", type=float, default=0.5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from asyncinfer.lab import load_trace

    trace = load_trace(args.trace) if args.trace else default_trace(args.requests, args.rate, args.seed)
    longest = max(trace, key=lambda t: t.prompt_len, default=None)
    if longest is not None and longest.prompt_len >= args.max_model_len:
        raise SystemExit(f"scheduler_lab.py: request {longest.id!r} of the trace has a {longest.prompt_len}-token "
                         f"prompt, which --max-model-len {args.max_model_len} does not hold (prompts must be shorter): "
                         "raise --max-model-len (up to the model's context) or give a --trace of shorter prompts")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    engine_options = {"device": "cpu", "dtype": "float32", "num_threads": args.threads,
                      "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                      "max_num_batched_tokens": args.max_num_batched_tokens, "kv_cache_memory": args.kv_cache_memory}
    if args.calibrate:
        from asyncinfer.commands.calibrate import calibrate

        cost: StepCostModel = calibrate(args.model, num_threads=args.threads, max_model_len=args.max_model_len)
        print(f"calibrated: {cost.coefficients} (mean relative error {cost.meta['fit_mean_rel_error']:.1%})")
    else:
        cost = load_cost_model(args.cost_model)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len)
    slo = Slo(args.slo_ttft, args.slo_tpot)
    print(f"trace: {len(trace)} requests, {sum(t.prompt_len for t in trace)} prompt / "
          f"{sum(t.output_len for t in trace)} output tokens over {trace[-1].arrival:.1f} s; policies {policies}")
    real: dict[str, Any] = {}
    sim: dict[str, Any] = {}
    sim_scaled: dict[float, dict[str, Any]] = {}
    for policy in policies:
        t0 = time.perf_counter()
        try:
            records, num_blocks, preemptions = asyncio.run(run_real(args.model, policy, trace, engine_options))
        except (ConfigurationError, InvalidParameterError, ModelLoadError) as exc:  # the model or the options
            raise SystemExit(f"scheduler_lab.py: {exc}") from None
        real[policy] = dataclasses.replace(summarize(policy, records, slo, wait_known=False), preemptions=preemptions)
        sim[policy] = summarize(policy, simulate(trace, policy, cost_model=cost, config=config, num_blocks=num_blocks,
                                                 block_size=16).records, slo)
        for scale in SCALES:
            scaled = StepCostModel({k: v * scale for k, v in cost.coefficients.items()})
            records = simulate(trace, policy, cost_model=scaled, config=config, num_blocks=num_blocks).records
            sim_scaled.setdefault(scale, {})[policy] = summarize(policy, records, slo)
        print(f"  {policy}: real run {time.perf_counter() - t0:.0f} s, {num_blocks} KV blocks", file=sys.stderr)
    print("\nreal engine (wall seconds; wait = TTFT):")
    print(format_table(list(real.values())))
    print("\nlab simulation (simulated seconds):")
    print(format_table(list(sim.values())))
    cmp = compare(real, sim)
    for metric, c in cmp.items():
        # The lab's best policy, recomputed with every step cost off by -15% / +15%.
        c["sim_stable"] = all(compare(real, alt)[metric]["sim"][0] == c["sim"][0] for alt in sim_scaled.values())
    print("\nordering, best first (real | lab); spread of the real figures; Kendall tau; best policy agrees; "
          "lab gap per policy:")
    for metric, c in cmp.items():
        gaps = " ".join(f"{p}={g:+.0%}" for p, g in c["gap"].items())
        print(f"  {metric:15s} {','.join(c['real']):45s} | {','.join(c['sim']):45s} spread={c['spread']:4.0%} "
              f"tau={c['tau']:+.2f} best={'yes' if c['best_agrees'] else 'no '}"
              f"{'' if c['sim_stable'] else ' (lab best not stable at +-15% cost)'}  {gaps}")
    gaps = sorted(abs(g) for c in cmp.values() for g in c["gap"].values())
    decisive = [c for c in cmp.values() if c["spread"] >= SPREAD and c["sim_stable"]]
    for label, group in (("all metrics", list(cmp.values())),
                         (f"metrics with a real spread >= {SPREAD:.0%} and a lab best stable at +-15% cost", decisive)):
        if group:
            print(f"{label}: mean tau {sum(c['tau'] for c in group) / len(group):+.2f}, best policy agrees on "
                  f"{sum(c['best_agrees'] for c in group)}/{len(group)}")
    print(f"median |gap| {gaps[len(gaps) // 2]:.0%}, max {gaps[-1]:.0%}")
    report = {"real": {k: v.to_dict() for k, v in real.items()}, "sim": {k: v.to_dict() for k, v in sim.items()},
              "compare": cmp, "cost_model": cost.to_dict() if args.calibrate else (args.cost_model or "shipped")}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2, default=str)
    return report


if __name__ == "__main__":
    main()
