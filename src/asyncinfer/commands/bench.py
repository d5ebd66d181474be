"""``asyncinfer bench``: throughput and latency of the engine at a few concurrencies.

Synthetic prompts (random token ids, seeded) of ``--input-len`` tokens each ask
for exactly ``--output-len`` tokens (EOS ignored), so every run does the same
work. At each concurrency ``c`` the ``--num-requests`` requests run with at most
``c`` in flight; the table gives output tokens/s, requests/s, time to first token
(TTFT), time per output token after the first (TPOT) and end-to-end latency.
``--compare-transformers`` runs the same prompts through transformers'
``generate()`` in static batches of ``c`` (greedy, fp32 on CPU) and counts the
requests whose greedy tokens are the same. One warm-up request runs first.
``--profile DIR`` then runs the prompts again at the highest concurrency under
``engine.profile()`` and prints the top ops (the Chrome trace goes to DIR).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from asyncinfer.commands import check_output_path, plot_path, read_number
from asyncinfer.errors import InvalidParameterError
from asyncinfer.metrics.profile import MAX_PROFILE_STEPS
from asyncinfer.sampling_params import SamplingParams

#: Steps --profile profiles unless --profile-steps says.
PROFILE_STEPS = 20
#: The most requests (and the highest concurrency level) a run takes: its prompts are made before it starts, a list
#: of --input-len ints each (--num-requests 100000000000 grew past 2.9 GB in 25 s, bound for the OOM killer).
BENCH_MAX_REQUESTS = 100_000


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", metavar="N", type=read_number(int, f"an integer in [1, {BENCH_MAX_REQUESTS}]"),
                   default=16, help=f"requests per concurrency level, at most {BENCH_MAX_REQUESTS} (default: 16)")
    p.add_argument("--input-len", metavar="TOKENS", type=read_number(int, "an integer >= 1"), default=128,
                   help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", metavar="TOKENS", type=read_number(int, "an integer >= 1"), default=32,
                   help="output tokens per request (default: 32)")
    p.add_argument("--concurrency", metavar="N", action="append", default=None,
                   help="comma-separated levels; repeatable, the levels of every occurrence run (default: 1,4,16)")
    p.add_argument("--seed", metavar="SEED", type=read_number(int, "an integer"), default=0, help="seed of the synthetic prompts (default: 0)")
    p.add_argument("--compare-transformers", action="store_true",
                   help="also run transformers' generate() on the same prompts (loads the model a second time)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw throughput and latency into this PNG (default: none)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the figures as JSON (default: none)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the table, profile --profile-steps engine steps at the highest concurrency with "
                        "engine.profile(): DIR/trace.json (Chrome trace) and DIR/top_ops.txt (default: none: no profile)")
    p.add_argument("--profile-steps", metavar="N", type=read_number(int, f"an integer in [1, {MAX_PROFILE_STEPS}]"),
                   default=None,
                   help=f"steps to profile with --profile (default: {PROFILE_STEPS})")


@dataclass(frozen=True)
class Row:
    """One system at one concurrency; seconds, except the rates."""

    system: str
    concurrency: int
    requests: int
    wall: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    e2e_p50: float
    e2e_p99: float
    same_tokens: str = ""


def run_bench(args: argparse.Namespace, options: dict[str, Any]) -> int:
    levels = _levels(args.concurrency)
    if args.profile_steps is not None and args.profile is None:  # it was ignored: no profile, and nothing said
        from asyncinfer.commands import CommandError

        raise CommandError("--profile-steps is used only with --profile DIR (where the profile is written)")
    if args.profile_steps is None:
        args.profile_steps = PROFILE_STEPS
    for name in ("num_requests", "input_len", "output_len", "profile_steps"):
        if getattr(args, name) < 1:
            raise InvalidParameterError(f"--{name.replace('_', '-')}", getattr(args, name), "an int >= 1")
    if args.num_requests > BENCH_MAX_REQUESTS:  # its prompts are made before the run
        raise InvalidParameterError("--num-requests", args.num_requests, f"an int in [1, {BENCH_MAX_REQUESTS}]")
    if args.profile_steps > MAX_PROFILE_STEPS:  # refused before the benchmark runs, not after it
        raise InvalidParameterError("--profile-steps", args.profile_steps, f"an int in [1, {MAX_PROFILE_STEPS}]")
    if args.json is not None:
        check_output_path("--json", args.json)
    if args.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise InvalidParameterError("--plot", args.plot, "a run with matplotlib installed (pip install matplotlib)")
        args.plot = plot_path(args.plot)
    if args.profile is not None and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        from asyncinfer.commands import CommandError

        raise CommandError(f"--profile {args.profile}: not a directory (a file is there; the profile writes "
                           "DIR/trace.json and DIR/top_ops.txt)")
    rows, model_path, ours = asyncio.run(_bench_engine(args.model_arg or args.model, options, args, levels))
    if args.compare_transformers:
        rows += _bench_transformers(model_path, args, levels, ours)
    print(format_rows(rows))
    if args.profile:
        print(args.profile_report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"settings": {k: getattr(args, k) for k in ("num_requests", "input_len", "output_len", "seed")},
                       "rows": [asdict(r) for r in rows]}, fh, indent=2)
    if args.plot:
        _plot(rows, args.plot)
        print(f"plot saved to {args.plot}")
    return 0


def _levels(given: list[str] | None) -> list[int]:
    """The concurrency levels of every ``--concurrency`` (each comma-separated), in order, each once."""
    levels: list[int] = []
    for text in given or ["1,4,16"]:
        try:  # every entry a number: "1,,4" ran levels 1 and 4, the empty one dropped unsaid
            these = [int(x) for x in text.split(",")]
        except ValueError:
            these = []
        if not these or min(these) < 1 or max(these) > BENCH_MAX_REQUESTS:
            raise InvalidParameterError("--concurrency", text, f"comma-separated ints in [1, {BENCH_MAX_REQUESTS}], "
                                        "e.g. 1,4,16")
        levels += [c for c in these if c not in levels]
    return levels


def _check_lengths(args: argparse.Namespace, max_model_len: int, context: int) -> None:
    """Each request's --input-len prompt tokens plus --output-len output tokens within the engine's max_model_len
    (``context``: the model's), said in the flags' terms (the engine's own refusal named ``prompt='<9000
    tokens>'`` and ``max_tokens``, neither of them a flag of bench)."""
    total = args.input_len + args.output_len
    if total > max_model_len:
        from asyncinfer.commands import CommandError

        if max_model_len < context:
            what, fix = "prompt + output", f" (or raise --max-model-len, up to the model's context, {context})"
        else:
            what, fix = "prompt + output, the model's context", ""
        raise CommandError(f"--input-len {args.input_len} + --output-len {args.output_len} = {total} tokens per "
                           f"request, more than --max-model-len {max_model_len} ({what}): lower --input-len or "
                           f"--output-len{fix}")


def _prompts(vocab_size: int, args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    low = min(100, vocab_size // 2)  # clear of the special tokens most vocabularies start with
    return [[rng.randrange(low, vocab_size) for _ in range(args.input_len)] for _ in range(args.num_requests)]


async def _bench_engine(
    model: Any, options: dict[str, Any], args: argparse.Namespace, levels: list[int]
) -> tuple[list[Row], str, dict[int, list[int]]]:
    from asyncinfer.engine import AsyncEngine

    engine = await AsyncEngine.load(model, **options)
    (info,) = engine.model_info()
    _check_lengths(args, info.memory_plan.max_model_len, engine.model_config.max_position_embeddings)
    prompts = _prompts(engine.model_config.vocab_size, args)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    rows: list[Row] = []
    tokens: dict[int, list[int]] = {}
    async with engine:
        await engine.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # warm-up

        async def one(i: int, limit: asyncio.Semaphore, timings: list[tuple[float, float, int]]) -> None:
            async with limit:
                start, first, n = time.perf_counter(), None, 0
                ids: list[int] = []
                async for delta in engine.stream(prompts[i], params):
                    first = first or time.perf_counter()
                    ids += delta.token_ids
                n = len(ids)
                tokens[i] = ids
                timings.append((first - start, time.perf_counter() - start, n))

        for c in levels:
            limit = asyncio.Semaphore(c)
            timings: list[tuple[float, float, int]] = []
            start = time.perf_counter()
            await asyncio.gather(*(one(i, limit, timings) for i in range(len(prompts))))
            rows.append(_row("asyncinfer", c, time.perf_counter() - start, timings))
        if args.profile:
            args.profile_report = await _profile(engine, prompts[:levels[-1]], params, args)
    return rows, engine.model_source.split(":", 1)[1], tokens


async def _profile(engine: Any, prompts: list[list[int]], params: SamplingParams, args: argparse.Namespace) -> str:
    """``engine.profile()`` over the next ``--profile-steps`` steps, with the prompts sent again meanwhile
    (a separate pass, so the profiler's overhead stays out of the table)."""
    profiling = asyncio.create_task(engine.profile(steps=args.profile_steps, path=args.profile))
    await asyncio.sleep(0)  # armed before the traffic starts
    while not profiling.done():
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    result = await profiling
    return (f"profile of {result.steps} steps at concurrency {len(prompts)}: {result.trace_path} (Chrome trace), "
            f"{result.table_path}\n" + "\n".join(result.table.splitlines()[:25]))


def _row(system: str, c: int, wall: float, timings: list[tuple[float | None, float, int]], same: str = "") -> Row:
    from asyncinfer.lab.report import percentile

    ttft = [t for t, _, _ in timings if t is not None]
    e2e = [e for _, e, _ in timings]
    tpot = [(e - t) / (n - 1) for t, e, n in timings if t is not None and n > 1]
    out = sum(n for _, _, n in timings)
    return Row(system, c, len(timings), wall, out / wall, len(timings) / wall,
               percentile(ttft, 50) if ttft else None, percentile(ttft, 99) if ttft else None,
               percentile(tpot, 50) if tpot else None, percentile(e2e, 50), percentile(e2e, 99), same)


def _bench_transformers(
    path: str, args: argparse.Namespace, levels: list[int], ours: dict[int, list[int]]
) -> list[Row]:
    """Static batches of ``c`` prompts through ``model.generate`` (every request waits for its batch)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    file = Path(path)
    kwargs = {"gguf_file": file.name} if file.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(file.parent if kwargs else file, dtype=torch.float32, **kwargs).eval()
    prompts = _prompts(model.config.vocab_size, args)
    rows = []
    for c in levels:
        timings, same = [], 0
        start = time.perf_counter()
        for b in range(0, len(prompts), c):
            batch = torch.tensor(prompts[b:b + c])  # all prompts have the same length: no padding
            began = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                     max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                     pad_token_id=0)
            ended = time.perf_counter() - began
            for j, row in enumerate(out[:, args.input_len:].tolist()):
                timings.append((None, ended, len(row)))
                same += row == ours.get(b + j)
        rows.append(_row("transformers", c, time.perf_counter() - start, timings, f"{same}/{len(prompts)}"))
    return rows


def format_rows(rows: list[Row]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    compared = any(r.same_tokens for r in rows)  # the last column only where a row compares tokens
    head = (f"{'system':<13}{'conc':>5}{'reqs':>6}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
            f"{'TPOT p50':>10}{'E2E p50':>10}{'E2E p99':>10}" + "  same greedy tokens" * compared)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.system:<13}{r.concurrency:>5}{r.requests:>6}{r.output_tokens_per_s:>9.1f}"
                     f"{r.requests_per_s:>8.2f}{ms(r.ttft_p50):>10}{ms(r.ttft_p99):>10}{ms(r.tpot_p50):>10}"
                     f"{ms(r.e2e_p50):>10}{ms(r.e2e_p99):>10}" + f"  {r.same_tokens}".rstrip() * compared)
    note = "; transformers' rows: each request waits for its whole batch" if any(
        r.system == "transformers" for r in rows) else ""
    return "\n".join(lines) + f"\n(latencies in ms{note})"


def _plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise InvalidParameterError("--plot", path, "a run with matplotlib installed (pip install matplotlib)") from exc
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for system in dict.fromkeys(r.system for r in rows):
        mine = [r for r in rows if r.system == system]
        xs = [r.concurrency for r in mine]
        left.plot(xs, [r.output_tokens_per_s for r in mine], marker="o", label=system)
        right.plot(xs, [1000 * r.e2e_p50 for r in mine], marker="o", label=system)
    for ax, label in ((left, "output tokens/s"), (right, "end-to-end latency p50 (ms)")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
