"""asyncinfer against llama.cpp on one GGUF file, side by side in one run: one request, many at once,
and the machine's read bandwidth as the bound both are measured against.

The file is any GGUF both engines load: the real default model, or a random-weight model at a real
shape written by ``benchmarks/make_gguf.py`` (``--llama-quantize q4_k_m`` has llama.cpp's own quantizer
write it, so both read the bytes users download). Both engines run in this process, one after the
other, on the same number of threads, with every prompt given as the same token ids:

1. **read bandwidth**: the best of ``--probe-repeats`` sums of a 1 GiB float32 buffer on ``--threads``
   threads (torch), GB/s: what a step that reads every weight once can at best reach. Taken at the start,
   and again just before and just after each one-request round: a virtual machine's bandwidth wanders over
   minutes (this one's probe has read 37-75 GB/s in runs hours apart), so each round is held against the
   faster of its own two probes (the stricter bound);
2. **one request**: ``--rounds`` rounds, each one request's decode rate in asyncinfer then llama.cpp (the
   order alternating between rounds), both as ``(n - 1) / (T(n) - T(1))`` (the prompt's time cancelled
   out); the per-round ratios and their median, and each engine's **bandwidth use**: weight bytes read per
   token (every tensor of the file but the token embedding, which a step gathers a few rows of, unless
   the head is tied to it) x tok/s / the round's probe, the median over the rounds;
3. **many requests**: ``--num-requests`` requests at t=0 (a shared ``--shared-prefix``-token system prompt,
   then a distinct random tail, output lengths drawn in [``--min-new-tokens``, ``--max-new-tokens``],
   greedy, EOS ignored): asyncinfer with its prefix cache on and off, llama.cpp with every slot count of
   ``--slots`` (its parallel sequences: llama.cpp recomputes the shared prefix in every sequence) and its
   best taken; then ``--many-rounds`` paired rounds (0 by default): asyncinfer with its prefix cache off and
   llama.cpp at that best slot count running the workload in turn (the order alternating between rounds), each
   in an engine loaded for the run and closed after it (as the sweep's: with both loaded, llama.cpp ran 12-28%
   slower than in its sweep), the per-round ratios, their median and the least of them: a round's two rates a
   minute apart, where the sweep's runs are minutes apart;
4. **prefill**: ``--prefill-rounds`` rounds, each a fresh random ``--prefill-tokens``-token prompt to its first
   token (one engine of each, one slot, asyncinfer's prefix cache off, the order alternating between rounds):
   prompt tokens / seconds of each, and the per-round ratios and their median.

The JSON record names the commit, the machine, llama.cpp's version and build (``llama_print_system_info``)
and every setting. Timings mean something only on a quiet machine (the load average is recorded at the
start and the end).

    python benchmarks/make_gguf.py /tmp/llama-1b-q4_k_m.gguf --shape 1b --llama-quantize q4_k_m
    python benchmarks/peer.py --model /tmp/llama-1b-q4_k_m.gguf --json benchmarks/results/peer_1b_q4_k_m.json
    python benchmarks/peer.py --model /tmp/llama-1b-q4_k_m.gguf --activation-dtype int8 --json ...
    python benchmarks/peer.py --model FILE --rounds 1 --num-requests 4 --max-new-tokens 8 --slots 4 \\
        --decode-tokens 8 --repeats 1 --probe-mib 64          # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

import torch
from common import engine_decode_rate, git_commit, machine_info, write_record

from asyncinfer.threads import on_own_thread

BENCH_DIR = Path(__file__).resolve().parent


def say(message: str) -> None:
    print(f"[peer] {message}", file=sys.stderr, flush=True)


def read_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of the best of ``repeats`` sums of a ``mib`` MiB float32 buffer (torch's threads), the buffer in small
    pages (``torch.ones``) and, where Linux grants them, in huge pages (``kernels.weight_buffer``, the memory the
    engine's weights are copied into): the better of the two, the most this machine reads at."""
    from asyncinfer import kernels

    kinds = [lambda: torch.ones(mib * 2**20 // 4, dtype=torch.float32)]
    if kernels.huge_pages():
        kinds.append(lambda: kernels.weight_buffer(mib * 2**20).view(torch.float32).fill_(1.0))
    best = math.inf
    for make in kinds:  # one buffer at a time
        buf = make()
        for _ in range(repeats + 1):  # the first pass warms the pages
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
        del buf  # freed before the next is made
    return mib * 2**20 / best / 1e9


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the file's tensors a decode step reads: all but the token embedding (of which a step reads a
    few rows), which counts when the file has no ``output.weight`` (the head tied to it)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if name != "token_embd.weight" or tied)


def workload(vocab: int, num_requests: int, shared: int, tail: tuple[int, int], new_tokens: tuple[int, int],
             seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (one shared prefix, then a distinct random tail each) and output lengths, from ``seed``."""
    rng = random.Random(seed)
    low = min(300, vocab - 1)  # past the special and byte tokens of make_gguf's vocabulary
    prefix = [rng.randrange(low, vocab) for _ in range(shared)]
    prompts = [prefix + [rng.randrange(low, vocab) for _ in range(rng.randint(*tail))] for _ in range(num_requests)]
    return prompts, [rng.randint(*new_tokens) for _ in range(num_requests)]


def llama_cpp_build() -> dict[str, str]:
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return {"version": getattr(llama_cpp, "__version__", "unknown"),
            "system_info": info.decode() if isinstance(info, bytes) else str(info)}


def commit() -> str:
    """HEAD's hash, marked when tracked files carry uncommitted changes (measured code that is not the commit's)."""
    head = git_commit()
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=BENCH_DIR,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return head
    return head + ("+uncommitted changes" if dirty else "")


async def _generate_all(engine: Any, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list[list[int]]]:
    from asyncinfer import SamplingParams

    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=n, ignore_eos=True))
                                  for p, n in zip(prompts, lengths)))
    wall = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outs]
    if [len(t) for t in tokens] != lengths:
        raise RuntimeError("asyncinfer returned the wrong number of tokens")
    return wall, tokens


async def load_engine(path: Path, args: argparse.Namespace, max_len: int, prefix_cache: bool) -> Any:
    from asyncinfer import AsyncEngine

    options = {"num_threads": args.threads, "max_num_seqs": args.num_requests, "max_model_len": max_len,
               "enable_prefix_caching": prefix_cache, "seed": args.seed, "activation_dtype": args.activation_dtype}
    # Room for every request at max_len, as llama.cpp has at 32 slots (one context of n_parallel * n_ctx_per_seq
    # tokens; twice this at 64, half at 16): without it the engine's default CPU budget holds
    # DEFAULT_KV_FULL_REQUESTS max-length requests and the rest of the requests wait for their turn.
    room = args.num_requests * max_len
    plan = AsyncEngine.plan_memory(str(path), **options)
    options["kv_cache_memory"] = -(-room // plan.block_size) * plan.block_bytes
    return await AsyncEngine.load(str(path), **options)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from llamacpp_peer import LlamaCppPeer, available

    why_not = available()
    if why_not is not None:
        raise SystemExit(f"llama.cpp is the peer of this benchmark and does not import: {why_not}")
    torch.set_num_threads(args.threads)
    path = Path(args.model)
    record: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(), "model": str(path), "model_mib": path.stat().st_size / 2**20,
        "settings": {k: v for k, v in vars(args).items() if k != "json"}, "load_average_start": os.getloadavg(),
        "llama_cpp": llama_cpp_build(),
    }
    say(f"read bandwidth probe ({args.probe_mib} MiB, {args.threads} threads)")
    probe = on_own_thread(read_bandwidth, args.probe_mib, args.probe_repeats)
    per_token = weight_bytes_per_token(path)
    record["read_bandwidth_start_gb_s"], record["weight_bytes_per_token"] = probe, per_token

    vocab: int | None = None  # the workload's token ids are drawn from the vocabulary the first engine reports
    prompts: list[list[int]] = []
    lengths: list[int] = []

    async def asyncinfer_session(prefix_cache: bool, single_rounds: int, peer_single: Any) -> dict[str, Any]:
        nonlocal prompts, lengths, vocab
        say(f"loading asyncinfer (prefix cache {'on' if prefix_cache else 'off'})")
        start = time.perf_counter()
        eng = await load_engine(path, args, n_ctx, prefix_cache)
        out: dict[str, Any] = {"load_s": time.perf_counter() - start,
                               "kv_tokens": eng.memory_plan.num_blocks * eng.memory_plan.block_size}
        if vocab is None:
            vocab = eng.model_config.vocab_size
            prompts, lengths = workload(vocab, args.num_requests, args.shared_prefix, (args.min_tail, args.max_tail),
                                        (args.min_new_tokens, args.max_new_tokens), args.seed)
        async with eng:
            await _generate_all(eng, prompts[:2], [4, 4])  # warm-up
            rounds = []
            for index in range(single_rounds):
                order = ("asyncinfer", "llama.cpp") if index % 2 == 0 else ("llama.cpp", "asyncinfer")
                rates = {}
                probes = [await asyncio.to_thread(on_own_thread, read_bandwidth, args.probe_mib, args.probe_repeats)]
                for system in order:
                    say(f"one request, round {index + 1}/{single_rounds}: {system}")
                    if system == "asyncinfer":
                        rates[system] = (await engine_decode_rate(eng, prompts[0], args.decode_tokens,
                                                                  args.repeats))["decode_tokens_per_s"]
                    else:
                        rates[system] = (await asyncio.to_thread(on_own_thread, peer_single.single_decode_rate,
                                                                 prompts[0], args.decode_tokens, args.repeats)
                                         )["decode_tokens_per_s"]
                probes.append(await asyncio.to_thread(on_own_thread, read_bandwidth, args.probe_mib, args.probe_repeats))
                bound = max(probes)
                rounds.append({"order": list(order), **rates, "ratio": rates["asyncinfer"] / rates["llama.cpp"],
                               "probe_gb_s": probes, **{f"{name}_bandwidth_use": rates[system] * per_token / 1e9 / bound
                                                        for name, system in (("asyncinfer", "asyncinfer"),
                                                                             ("llama_cpp", "llama.cpp"))}})
            say(f"{args.num_requests} requests, asyncinfer, prefix cache {'on' if prefix_cache else 'off'}")
            wall, tokens = await _generate_all(eng, prompts, lengths)
        out.update({"rounds": rounds, "many_wall_s": wall, "many_tokens_per_s": sum(lengths) / wall,
                    "tokens": tokens})
        return out

    n_ctx = args.shared_prefix + args.max_tail + max(args.max_new_tokens, args.decode_tokens) + 16
    say("loading llama.cpp (one slot) for the single-request rounds")
    single_peer = on_own_thread(LlamaCppPeer, path, args.threads, 1, n_ctx)
    try:
        on = asyncio.run(asyncinfer_session(True, args.rounds, single_peer))
    finally:
        on_own_thread(single_peer.close)
    off = asyncio.run(asyncinfer_session(False, 0, None))
    prefill = prefill_rounds(path, args, vocab) if args.prefill_rounds else None

    slots = {}
    for n in args.slots:
        say(f"{args.num_requests} requests, llama.cpp with {n} slots")
        done, wall, steps = llama_cpp_many(path, args.threads, n, n_ctx, prompts, lengths)
        slots[n] = {"wall_s": wall, "steps": steps, "tokens_per_s": sum(lengths) / wall,
                    "tokens": [done[i] for i in range(len(prompts))]}
    best = max(slots, key=lambda n: slots[n]["tokens_per_s"])
    paired = paired_many_rounds(path, args, n_ctx, prompts, lengths, best) if args.many_rounds else None

    rounds = on["rounds"]
    single = {
        "rounds": rounds,
        "asyncinfer_median_tokens_per_s": statistics.median(r["asyncinfer"] for r in rounds),
        "llama_cpp_median_tokens_per_s": statistics.median(r["llama.cpp"] for r in rounds),
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
    }
    for system in ("asyncinfer", "llama_cpp"):
        single[f"{system}_bandwidth_use"] = statistics.median(r[f"{system}_bandwidth_use"] for r in rounds)
    # the bound the uses were taken against: the median of the rounds' probes (each round's faster one)
    record["read_bandwidth_gb_s"] = statistics.median(max(r["probe_gb_s"]) for r in rounds)
    agree = sum(a == b for a, b in zip(on["tokens"], slots[best]["tokens"]))
    record.update({
        "workload": {"num_requests": len(prompts), "shared_prefix": args.shared_prefix,
                     "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(lengths)},
        "one_request": single,
        "many": {
            "asyncinfer_prefix_cache_on_tokens_per_s": on["many_tokens_per_s"],
            "asyncinfer_prefix_cache_off_tokens_per_s": off["many_tokens_per_s"],
            "llama_cpp_by_slots": {str(n): {k: v for k, v in r.items() if k != "tokens"} for n, r in slots.items()},
            "llama_cpp_best_slots": best,
            "llama_cpp_best_tokens_per_s": slots[best]["tokens_per_s"],
            "ratio_prefix_cache_on": on["many_tokens_per_s"] / slots[best]["tokens_per_s"],
            "ratio_prefix_cache_off": off["many_tokens_per_s"] / slots[best]["tokens_per_s"],
            "greedy_identical_requests_vs_llama_cpp": agree,
            "asyncinfer_cache_on_off_identical": sum(a == b for a, b in zip(on["tokens"], off["tokens"])),
            "paired": paired,
        },
        "prefill": prefill,
        "asyncinfer_load_s": on["load_s"],
        "asyncinfer_kv_tokens": on["kv_tokens"],
        "llama_cpp_kv_tokens_by_slots": {str(n): n * n_ctx for n in args.slots},
        "machine": machine_info(),
        "load_average_end": os.getloadavg(),
    })
    return record


def prefill_rounds(path: Path, args: argparse.Namespace, vocab: int | None) -> dict[str, Any]:
    """Prompt tokens / second to the first token of a fresh random prompt, each engine, paired rounds."""
    from llamacpp_peer import LlamaCppPeer

    from asyncinfer import SamplingParams

    n_ctx = args.prefill_tokens + 16
    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(1, vocab or 2) for _ in range(args.prefill_tokens)] for _ in range(args.prefill_rounds + 1)]
    say(f"prefill: loading both engines ({args.prefill_tokens}-token prompts)")
    peer = on_own_thread(LlamaCppPeer, path, args.threads, 1, n_ctx)

    async def session() -> list[dict[str, Any]]:
        eng = await load_engine(path, args, n_ctx, False)
        rounds = []
        async with eng:
            await eng.generate(prompts[0][:32], SamplingParams(max_tokens=1))  # warm-up
            on_own_thread(peer.run, [prompts[0][:32]], [1])
            for index, prompt in enumerate(prompts[1:]):
                order = ("asyncinfer", "llama.cpp") if index % 2 == 0 else ("llama.cpp", "asyncinfer")
                rates = {}
                for system in order:
                    say(f"prefill, round {index + 1}/{args.prefill_rounds}: {system}")
                    if system == "asyncinfer":
                        start = time.perf_counter()
                        await eng.generate(prompt, SamplingParams(max_tokens=1))
                        rates[system] = len(prompt) / (time.perf_counter() - start)
                    else:
                        rates[system] = len(prompt) / (await asyncio.to_thread(on_own_thread, peer.run, [prompt], [1]))[1]
                rounds.append({"order": list(order), **rates, "ratio": rates["asyncinfer"] / rates["llama.cpp"]})
        return rounds

    try:
        rounds = asyncio.run(session())
    finally:
        on_own_thread(peer.close)
    return {"prompt_tokens": args.prefill_tokens, "rounds": rounds,
            "asyncinfer_median_tokens_per_s": statistics.median(r["asyncinfer"] for r in rounds),
            "llama_cpp_median_tokens_per_s": statistics.median(r["llama.cpp"] for r in rounds),
            "median_ratio": statistics.median(r["ratio"] for r in rounds)}


def llama_cpp_many(path: Path, threads: int, slots: int, n_ctx: int, prompts: list[list[int]],
                   lengths: list[int]) -> tuple[dict[int, list[int]], float, int]:
    """The many-requests workload on llama.cpp with ``slots`` slots, in a context loaded for it (warmed up) and
    closed after it: its tokens by request, its wall time and its steps (``LlamaCppPeer.run``'s)."""
    from llamacpp_peer import LlamaCppPeer

    peer = on_own_thread(LlamaCppPeer, path, threads, slots, n_ctx)
    try:
        on_own_thread(peer.run, prompts[:2], [4, 4])  # warm-up
        return on_own_thread(peer.run, prompts, lengths)
    finally:
        on_own_thread(peer.close)


def paired_many_rounds(path: Path, args: argparse.Namespace, n_ctx: int, prompts: list[list[int]],
                       lengths: list[int], slots: int) -> dict[str, Any]:
    """The many-requests workload in paired rounds: asyncinfer (prefix cache off) and llama.cpp at ``slots`` (its
    best of the sweep) in turn, the order alternating between rounds; each run as the sweep's are, in an engine
    loaded for it (and warmed up) and closed after it, so that neither engine is resident while the other runs."""
    async def asyncinfer_run() -> float:
        eng = await load_engine(path, args, n_ctx, False)
        async with eng:
            await _generate_all(eng, prompts[:2], [4, 4])  # warm-up
            return (await _generate_all(eng, prompts, lengths))[0]

    rounds = []
    for index in range(args.many_rounds):
        order = ("asyncinfer", "llama.cpp") if index % 2 == 0 else ("llama.cpp", "asyncinfer")
        rates = {}
        for system in order:
            say(f"{args.num_requests} requests, paired round {index + 1}/{args.many_rounds}: {system}"
                + (f" ({slots} slots)" if system == "llama.cpp" else " (prefix cache off)"))
            wall = (asyncio.run(asyncinfer_run()) if system == "asyncinfer"
                    else llama_cpp_many(path, args.threads, slots, n_ctx, prompts, lengths)[1])
            rates[system] = sum(lengths) / wall
        rounds.append({"order": list(order), **rates, "ratio": rates["asyncinfer"] / rates["llama.cpp"]})
    return {"llama_cpp_slots": slots, "rounds": rounds,
            "asyncinfer_median_tokens_per_s": statistics.median(r["asyncinfer"] for r in rounds),
            "llama_cpp_median_tokens_per_s": statistics.median(r["llama.cpp"] for r in rounds),
            "median_ratio": statistics.median(r["ratio"] for r in rounds),
            "min_ratio": min(r["ratio"] for r in rounds)}


def report(r: dict[str, Any]) -> None:
    one, many = r["one_request"], r["many"]
    ratios = ", ".join(f"{x['ratio']:.2f}" for x in one["rounds"])
    print(f"model: {r['model']} ({r['model_mib']:.1f} MiB), {r['settings']['threads']} threads, commit {r['commit']}, "
          f"asyncinfer activation_dtype={r['settings'].get('activation_dtype', 'int16')}")
    print(f"read bandwidth probe: {r['read_bandwidth_gb_s']:.1f} GB/s (the rounds' median; "
          f"{r['read_bandwidth_start_gb_s']:.1f} at the start); weight bytes per token "
          f"{r['weight_bytes_per_token'] / 2**20:.1f} MiB")
    print(f"one request ({len(one['rounds'])} paired rounds): asyncinfer {one['asyncinfer_median_tokens_per_s']:.1f} "
          f"tok/s ({one['asyncinfer_bandwidth_use']:.0%} of the probe), llama.cpp "
          f"{one['llama_cpp_median_tokens_per_s']:.1f} ({one['llama_cpp_bandwidth_use']:.0%}); asyncinfer / llama.cpp "
          f"median {one['median_ratio']:.2f}x (rounds {ratios})")
    print(f"{r['workload']['num_requests']} requests ({r['workload']['output_tokens']} output tokens, "
          f"{r['workload']['shared_prefix']}-token shared prefix): asyncinfer "
          f"{many['asyncinfer_prefix_cache_on_tokens_per_s']:.1f} tok/s (prefix cache on), "
          f"{many['asyncinfer_prefix_cache_off_tokens_per_s']:.1f} (off); llama.cpp best "
          f"{many['llama_cpp_best_tokens_per_s']:.1f} at {many['llama_cpp_best_slots']} slots ("
          + ", ".join(f"{n}: {s['tokens_per_s']:.1f}" for n, s in many["llama_cpp_by_slots"].items())
          + f"); ratio {many['ratio_prefix_cache_on']:.2f}x (cache on), {many['ratio_prefix_cache_off']:.2f}x (off)")
    paired = many.get("paired")
    if paired:
        print(f"{r['workload']['num_requests']} requests, {len(paired['rounds'])} paired rounds (prefix cache off; "
              f"llama.cpp at {paired['llama_cpp_slots']} slots): asyncinfer {paired['asyncinfer_median_tokens_per_s']:.1f} "
              f"tok/s, llama.cpp {paired['llama_cpp_median_tokens_per_s']:.1f}; median {paired['median_ratio']:.2f}x, "
              f"least {paired['min_ratio']:.2f}x (rounds " + ", ".join(f"{x['ratio']:.2f}" for x in paired["rounds"]) + ")")
    pre = r.get("prefill")
    if pre:
        print(f"prefill ({pre['prompt_tokens']}-token prompts, {len(pre['rounds'])} paired rounds): asyncinfer "
              f"{pre['asyncinfer_median_tokens_per_s']:.1f} tok/s, llama.cpp {pre['llama_cpp_median_tokens_per_s']:.1f}; "
              f"median {pre['median_ratio']:.2f}x (rounds " + ", ".join(f"{x['ratio']:.2f}" for x in pre["rounds"]) + ")")
    print(f"load average: {r['load_average_start']} at the start, {r['load_average_end']} at the end")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file both engines load")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=5, help="paired rounds of the one-request rate")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens of the one-request rate")
    p.add_argument("--repeats", type=int, default=3, help="repeats (median) inside each one-request timing")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--shared-prefix", type=int, default=64, help="tokens of the prompt every request shares")
    p.add_argument("--min-tail", type=int, default=8)
    p.add_argument("--max-tail", type=int, default=64)
    p.add_argument("--min-new-tokens", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--slots", type=int, nargs="+", default=[16, 32, 64], help="llama.cpp's slot counts to sweep")
    p.add_argument("--probe-mib", type=int, default=1024)
    p.add_argument("--probe-repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--activation-dtype", choices=("int16", "int8", "bfloat16"), default="int16",
                   help="asyncinfer's activation_dtype (int8: llama.cpp's numerics, faster; bfloat16: prefills in "
                        "bfloat16, fast with AMX; docs/formats.md)")
    p.add_argument("--many-rounds", type=int, default=0,
                   help="paired rounds of the many-requests workload after the slot sweep (0: none): asyncinfer "
                        "(prefix cache off) and llama.cpp at its best slot count taking turns, each loaded for its run")
    p.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens of the prefill rounds")
    p.add_argument("--prefill-rounds", type=int, default=3, help="paired prefill rounds (0: none)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.prefill_tokens < 1 or args.prefill_rounds < 0:
        p.error("--prefill-tokens must be at least 1 and --prefill-rounds at least 0")
    if args.many_rounds < 0:
        p.error(f"--many-rounds must be at least 0 (given {args.many_rounds})")
    for name in ("threads", "rounds", "decode_tokens", "repeats", "num_requests", "probe_mib", "probe_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.min_tail <= args.max_tail:
        p.error(f"need 0 <= --min-tail <= --max-tail (given --min-tail {args.min_tail}, --max-tail {args.max_tail})")
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        p.error(f"need 1 <= --min-new-tokens <= --max-new-tokens (given --min-new-tokens {args.min_new_tokens}, "
                f"--max-new-tokens {args.max_new_tokens}; the defaults are 32 and 128)")
    if args.decode_tokens < 2:
        p.error("--decode-tokens must be at least 2 (the rate is (n - 1) / (T(n) - T(1)))")
    record = run(args)
    report(record)
    if args.json:
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
