"""The KV memory system on the real model: paged waste during the throughput workload, and
the speed-up of prefix caching on a shared-system-prompt workload.

Part 1 (waste). The throughput workload of ``benchmarks/common.py`` (chat questions,
output lengths drawn in [min, max], EOS ignored, everything arriving at t=0) runs
through the engine core step by step. After every step it reads ``kv_stats()`` and
compares three ways of holding the same sequences:

* paged (this engine): allocated = used blocks x block_size, filled = slots holding a
  token (a block shared by several requests counts once);
* contiguous, max length: what a cache reserved per sequence for ``max_model_len``
  tokens (transformers' static cache, vLLM's "before paging" figure) would hold;
* contiguous, exact: reserved per sequence for its own prompt + ``max_tokens`` (the
  best a contiguous cache can do, and only if it knows every output length ahead).

Waste is ``1 - filled / allocated`` summed over all steps (so a step holding more
memory weighs more); the step of peak memory is reported on its own.

Part 2 (prefix caching). ``--prefix-requests`` chat requests share one long system
prompt and differ in the user question. They go through ``AsyncEngine.generate`` all
at once, on one engine, alternately with prefix caching on and off (the manager's
switch flipped between runs; the cache is reset before each run so every run starts
cold). Medians of ``--repeats`` runs; the outputs of both modes must be identical.

    python benchmarks/kv_cache.py                  # full run, about 5 minutes on 2 busy CPU cores
    python benchmarks/kv_cache.py --num-requests 8 --max-new-tokens 32 --prefix-requests 4 --repeats 1
    python benchmarks/kv_cache.py --skip-prefix --block-size 8      # waste with smaller blocks

``--num-requests 64`` is exactly ``throughput.py``'s default workload (48 keeps the
default run short; the workload is drawn the same way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_workload, machine_info, resolve_model_path

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Outfitters, a shop that sells hiking, camping and "
    "climbing gear online and in three stores. Follow these rules in every answer. Be friendly, "
    "brief and concrete; prefer short paragraphs or a short list. Never invent prices, stock levels, "
    "delivery dates or order details: if the customer asks for them, explain that you cannot see "
    "live data and point them to the order page or to the phone line, which is open from 8 am to "
    "6 pm on weekdays. Returns are accepted within 60 days for unused items with the receipt; worn "
    "footwear can be returned within 14 days if it does not fit. Repairs of tents, backpacks and "
    "jackets are free for two years after purchase, and at cost afterwards. Rental gear must be "
    "cleaned and dried before it is returned; a cleaning fee applies otherwise. Safety comes first: "
    "for questions about avalanche terrain, glacier travel, rope work or first aid, give general "
    "guidance only and recommend a certified guide or course. Do not give medical advice. When a "
    "customer is unhappy, apologise once, restate the problem in one sentence, and offer the next "
    "concrete step. When you recommend a product category, mention what to look for (weight, "
    "materials, fit, care) rather than brand names. Answer in the customer's language. If a "
    "question has nothing to do with outdoor gear or the shop, answer it briefly and politely."
)

PREFIX_QUESTIONS = (
    "Can I return boots I wore on one short walk?",
    "What should I look for in a first tent for two people?",
    "My jacket zip broke after a year. What can I do?",
    "How do I clean a rented sleeping bag before returning it?",
    "Which backpack size do I need for a three-day hike?",
    "Is it safe to cross a glacier without a guide?",
    "What is the difference between down and synthetic insulation?",
    "Do you have stores open on Sunday?",
    "How should hiking boots fit when I try them on?",
    "Can you recommend a stove for winter camping?",
    "I was charged twice for my order. Who can help me?",
    "What do I need for my first indoor climbing session?",
    "How do I waterproof my old rain jacket again?",
    "Are trekking poles worth it for a beginner?",
    "How warm should a sleeping bag be for spring camping?",
    "What should a basic first-aid kit for hiking contain?",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or HF model directory (default: asyncinfer's default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    # Part 1: the throughput workload.
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-new-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    # Part 2: the shared system prompt.
    p.add_argument("--prefix-requests", type=int, default=16)
    p.add_argument("--prefix-new-tokens", type=int, default=16)
    p.add_argument("--system-repeat", type=int, default=1,
                   help="repeat the system prompt this many times (a longer shared prefix)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-waste", action="store_true")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--json", help="also write the figures to this file")
    return p.parse_args(argv)


def say(message: str) -> None:
    print(f"[kv_cache] {message}", file=sys.stderr, flush=True)


def make_engine(model_path: Path, args: argparse.Namespace, *, max_model_len: int, max_num_seqs: int) -> Any:
    """An engine whose KV cache holds ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    from asyncinfer import AsyncEngine

    plan = AsyncEngine.plan_memory(str(model_path), dtype=args.dtype, device="cpu", block_size=args.block_size,
                                   max_model_len=max_model_len, kv_cache_memory=1 << 40, available_bytes=1 << 42)
    kv_bytes = int(max_num_seqs * math.ceil(max_model_len / args.block_size) * plan.block_bytes * 1.1)
    return AsyncEngine.from_pretrained(
        str(model_path), dtype=args.dtype, device="cpu", block_size=args.block_size,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, kv_cache_memory=kv_bytes, num_threads=args.threads, seed=args.seed,
    )


# =========================================================================== part 1: waste


def measure_waste(model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from common import hf_load_args
    from transformers import AutoTokenizer

    from asyncinfer import SamplingParams
    from asyncinfer.request import Request

    directory, kwargs = hf_load_args(model_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    workload = build_workload(tokenizer, args.num_requests, args.seed, args.min_new_tokens, args.max_new_tokens)
    bs = args.block_size
    max_model_len = math.ceil((workload.max_seq_len + 1) / bs) * bs
    engine = make_engine(model_path, args, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs)
    core, kv = engine.core, engine.kv_manager
    requests = [
        Request(f"w{i}", list(p), SamplingParams(max_tokens=n, ignore_eos=True), arrival_time=time.time())
        for i, (p, n) in enumerate(zip(workload.prompt_ids, workload.max_new_tokens))
    ]
    final_len = {r.request_id: r.num_prompt_tokens + r.params.max_tokens for r in requests}
    for r in requests:
        core.add_request(r)
    totals = {"paged_alloc": 0, "paged_filled": 0, "tokens": 0, "max_len_reserved": 0, "exact_reserved": 0}
    peak: dict[str, Any] = {"allocated_slots": -1}
    steps = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        s = kv.stats()
        holders = kv.request_ids()
        tokens = sum(kv.num_slots(rid) for rid in holders)  # per sequence, shared prefixes counted each time
        max_len_reserved = len(holders) * max_model_len
        exact_reserved = sum(final_len[rid] for rid in holders)
        totals["paged_alloc"] += s.allocated_slots
        totals["paged_filled"] += s.filled_slots
        totals["tokens"] += tokens
        totals["max_len_reserved"] += max_len_reserved
        totals["exact_reserved"] += exact_reserved
        if s.allocated_slots > peak["allocated_slots"]:
            peak = {"step": steps, "sequences": len(holders), "allocated_slots": s.allocated_slots,
                    "filled_slots": s.filled_slots, "tokens": tokens, "max_len_reserved": max_len_reserved,
                    "exact_reserved": exact_reserved}
    wall = time.perf_counter() - start
    done = [len(r.output_token_ids) == r.params.max_tokens for r in requests]
    if not all(done):
        raise RuntimeError("a request did not produce its drawn number of tokens")
    stats = kv.stats()
    block_bytes = engine.memory_plan.block_bytes
    token_bytes = block_bytes // bs
    return {
        "workload": workload.summary(),
        "block_size": bs,
        "max_model_len": max_model_len,
        "kv_cache": engine.memory_plan.describe(),
        "steps": steps,
        "wall_s": wall,
        "output_tokens_per_s": workload.total_output_tokens / wall,
        "waste_paged": 1 - totals["paged_filled"] / totals["paged_alloc"],
        "waste_contiguous_max_len": 1 - totals["tokens"] / totals["max_len_reserved"],
        "waste_contiguous_exact": 1 - totals["tokens"] / totals["exact_reserved"],
        "sharing_saved": 1 - totals["paged_filled"] / totals["tokens"],
        "peak": {
            **peak,
            "waste_paged": 1 - peak["filled_slots"] / peak["allocated_slots"],
            "waste_contiguous_max_len": 1 - peak["tokens"] / peak["max_len_reserved"],
            "waste_contiguous_exact": 1 - peak["tokens"] / peak["exact_reserved"],
            "paged_mib": peak["allocated_slots"] // bs * block_bytes / 2**20,
            "contiguous_max_len_mib": peak["max_len_reserved"] * token_bytes / 2**20,
            "contiguous_exact_mib": peak["exact_reserved"] * token_bytes / 2**20,
        },
        "prefix_hit_rate": stats.prefix_hit_rate,
        "preemptions": stats.preemptions,
    }


# =========================================================================== part 2: prefix caching


def prefix_prompts(engine: Any, args: argparse.Namespace) -> list[list[int]]:
    system = " ".join([SYSTEM_PROMPT] * args.system_repeat)
    prompts = []
    for i in range(args.prefix_requests):
        question = PREFIX_QUESTIONS[i % len(PREFIX_QUESTIONS)]
        if i >= len(PREFIX_QUESTIONS):
            question += f" (question {i})"
        prompts.append(engine.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": question}]))
    return prompts


def common_prefix(prompts: list[list[int]]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if len({p[i] for p in prompts}) > 1:
            return i
    return n


async def _prefix_runs(engine: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from asyncinfer import SamplingParams

    params = SamplingParams(max_tokens=args.prefix_new_tokens, ignore_eos=True)
    kv, stats = engine.kv_manager, engine.core.stats
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    outputs: dict[str, list[list[int]]] = {}

    async def one(mode: str) -> None:
        kv.enable_prefix_caching = mode == "on"
        kv.reset_prefix_cache()  # every run starts cold
        prefill_before, hits_before = stats.prefill_tokens, kv.num_prefix_hits
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        wall = time.perf_counter() - t0
        outputs[mode] = [o.token_ids for o in outs]
        runs[mode].append({
            "wall_s": wall,
            "prefill_tokens": stats.prefill_tokens - prefill_before,
            "prefix_hit_tokens": kv.num_prefix_hits - hits_before,
            "ttft_median_s": statistics.median(o.metrics.ttft for o in outs),
        })

    async with engine:
        await engine.generate(prompts[0][:32], SamplingParams(max_tokens=2))  # warm-up
        for r in range(args.repeats):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                say(f"prefix caching {mode}, run {r + 1}/{args.repeats}")
                await one(mode)
    kv.enable_prefix_caching = True
    if outputs["on"] != outputs["off"]:
        raise RuntimeError("prefix caching changed the generated tokens")
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {
            "wall_s_median": statistics.median(r["wall_s"] for r in rs),
            "ttft_median_s": statistics.median(r["ttft_median_s"] for r in rs),
            "prefill_tokens": rs[0]["prefill_tokens"],
            "prefix_hit_tokens": rs[0]["prefix_hit_tokens"],
            "runs": rs,
        }
    summary["speedup_wall"] = summary["off"]["wall_s_median"] / summary["on"]["wall_s_median"]
    summary["speedup_ttft"] = summary["off"]["ttft_median_s"] / summary["on"]["ttft_median_s"]
    summary["outputs_identical"] = True
    return summary


def measure_prefix(model_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    probe = make_engine(model_path, args, max_model_len=2 * args.block_size, max_num_seqs=1)
    prompts = prefix_prompts(probe, args)
    del probe
    bs = args.block_size
    max_model_len = math.ceil((max(len(p) for p in prompts) + args.prefix_new_tokens + 1) / bs) * bs
    engine = make_engine(model_path, args, max_model_len=max_model_len, max_num_seqs=len(prompts))
    result = asyncio.run(_prefix_runs(engine, prompts, args))
    result.update({
        "requests": len(prompts),
        "prompt_tokens_total": sum(len(p) for p in prompts),
        "shared_prefix_tokens": common_prefix(prompts),
        "new_tokens_per_request": args.prefix_new_tokens,
        "repeats": args.repeats,
    })
    return result


# =========================================================================== report


def print_waste(w: dict[str, Any]) -> None:
    wl = w["workload"]
    pk = w["peak"]
    print(f"KV waste during the throughput workload: {wl['num_requests']} chat requests, prompts "
          f"{wl['prompt_tokens_min']}-{wl['prompt_tokens_max']} tokens, outputs {wl['output_tokens_min']}-"
          f"{wl['output_tokens_max']} tokens, block_size {w['block_size']}, max_model_len {w['max_model_len']}")
    print(f"  {w['steps']} steps in {w['wall_s']:.1f} s ({w['output_tokens_per_s']:.0f} output tokens/s), "
          f"{w['preemptions']} preemptions, prefix-cache hit rate {w['prefix_hit_rate']:.1%}")
    print("  waste = allocated-but-empty slots / allocated slots, summed over every step:")
    print(f"    paged blocks (asyncinfer)                 {w['waste_paged']:7.2%}")
    print(f"    contiguous, max_model_len per sequence    {w['waste_contiguous_max_len']:7.2%}")
    print(f"    contiguous, prompt + max_tokens per seq.  {w['waste_contiguous_exact']:7.2%}")
    print(f"  shared prefix blocks saved {w['sharing_saved']:.2%} of the per-sequence token slots")
    print(f"  at the peak step ({pk['sequences']} sequences): paged {pk['paged_mib']:.1f} MiB "
          f"(waste {pk['waste_paged']:.2%}); contiguous max-length {pk['contiguous_max_len_mib']:.1f} MiB "
          f"(waste {pk['waste_contiguous_max_len']:.2%}); contiguous exact {pk['contiguous_exact_mib']:.1f} MiB "
          f"(waste {pk['waste_contiguous_exact']:.2%})")


def print_prefix(p: dict[str, Any]) -> None:
    on, off = p["on"], p["off"]
    print(f"Shared system prompt: {p['requests']} requests at once, {p['shared_prefix_tokens']} shared prompt "
          f"tokens, {p['prompt_tokens_total']} prompt tokens in all, {p['new_tokens_per_request']} new tokens "
          f"each; medians of {p['repeats']} runs per mode")
    print(f"  prefix caching off: {off['wall_s_median']:6.2f} s, median TTFT {off['ttft_median_s']:.2f} s, "
          f"{off['prefill_tokens']} prompt tokens computed")
    print(f"  prefix caching on:  {on['wall_s_median']:6.2f} s, median TTFT {on['ttft_median_s']:.2f} s, "
          f"{on['prefill_tokens']} prompt tokens computed ({on['prefix_hit_tokens']} taken from the cache)")
    print(f"  speed-up: {p['speedup_wall']:.2f}x wall time, {p['speedup_ttft']:.2f}x median TTFT; "
          "outputs identical: yes")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    started = time.perf_counter()
    record: dict[str, Any] = {"command": " ".join(sys.argv), "model": str(model_path), "machine": machine_info()}
    if not args.skip_waste:
        say("part 1: KV waste during the throughput workload")
        record["waste"] = measure_waste(model_path, args)
    if not args.skip_prefix:
        say("part 2: prefix caching on vs off")
        record["prefix"] = measure_prefix(model_path, args)
    m = record["machine"]
    print(f"model {model_path.name}, {args.dtype}, {m['cpu']}, {m['torch_threads']} torch threads")
    if "waste" in record:
        print_waste(record["waste"])
    if "prefix" in record:
        print_prefix(record["prefix"])
    record["total_s"] = time.perf_counter() - started
    print(f"benchmark time {record['total_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
