"""Offline throughput: asyncinfer against transformers, on the same weights, dtype and inputs.

One process, one model file, one workload (token ids computed once):

1. transformers ``generate()``, one request at a time (greedy; a subset, reported per token);
2. transformers ``generate()`` in static, left-padded batches, in arrival order;
3. transformers' own continuous batching (``ContinuousBatchingManager``, paged KV cache, sdpa);
4. asyncinfer (``AsyncEngine.generate`` for every request at once), and with ``--formats``
   once per extra weight format;
5. llama.cpp on the same GGUF file (its own kernels for the file's quantization), when
   llama-cpp-python is installed (``benchmarks/llamacpp_peer.py``).

Plus a single-request decode comparison, a GEMM roofline, and (``--profile``) a
torch.profiler table of one asyncinfer decode step. See ``benchmarks/README.md``.

Every system's torch (or llama.cpp) work runs on a thread that ends with it
(``asyncinfer.on_own_thread``): a thread left alive with an OpenMP team slows every
other thread's parallel ops (``benchmarks/threads.py``), and the main thread hosts
asyncinfer's event loop, as in an application.

    python benchmarks/throughput.py                       # full run (minutes)
    python benchmarks/throughput.py --num-requests 4 --min-new-tokens 4 --max-new-tokens 8 \\
        --max-num-seqs 4 --static-batch-size 2 --hf-single-subset 2 --decode-tokens 8 \\
        --repeats 1 --gemm-size 512 --threads 1 --profile     # smoke test (about a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

# transformers' GGUF loader draws a plain tqdm bar that ignores its own progress-bar switch.
os.environ.setdefault("TQDM_DISABLE", "1")

import torch

from asyncinfer.threads import on_own_thread

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    SystemResult,
    Workload,
    build_workload,
    engine_decode_rate,
    latency_summary,
    load_hf_reference,
    machine_info,
    resolve_model_path,
    token_agreement,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# =========================================================================== CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="a .gguf file or HF model directory (default: asyncinfer's default model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights/activations of every system")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-new-tokens", type=int, default=16, help="shortest output length drawn")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest output length drawn")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests per step (asyncinfer and HF CB)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (asyncinfer and HF CB)")
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--hf-single-subset", type=int, default=8, help="requests run by HF one-at-a-time")
    p.add_argument("--hf-cb-api", choices=("manager", "generate_batch"), default="manager",
                   help="manager: per-request max_new_tokens via add_request (default);\n"
                        "generate_batch: model.generate_batch(), one max_new_tokens for all")
    p.add_argument("--hf-cb-page-size", type=int, default=256, help="ContinuousBatchingConfig.page_size")
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens in the single-request decode test")
    p.add_argument("--repeats", type=int, default=3, help="repeats (median) of the short timings")
    p.add_argument("--gemm-size", type=int, default=2048, help="n of the n x n x n roofline GEMM")
    p.add_argument("--skip-hf-single", action="store_true")
    p.add_argument("--skip-hf-static", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    p.add_argument("--skip-asyncinfer", action="store_true")
    p.add_argument("--skip-single-decode", action="store_true", help="skip the single-request decode comparison")
    p.add_argument("--skip-roofline", action="store_true")
    p.add_argument("--skip-llamacpp", action="store_true",
                   help="skip llama.cpp (run by default when llama-cpp-python is installed and the model is a .gguf)")
    p.add_argument("--llamacpp-parallel", type=int, default=16, help="llama.cpp's parallel sequences (slots)")
    p.add_argument("--paired-rounds", type=int, default=0,
                   help="right after llama.cpp's run, this many more rounds of asyncinfer's default and\n"
                        "llama.cpp on the workload, back to back, the order alternating; the median of the\n"
                        "rounds' ratios (needs llama.cpp)")
    p.add_argument("--formats", default="",
                   help="extra asyncinfer runs, one per quantization= value, comma-separated (e.g. float32,int8); "
                        "'float32' is quantization=None (float32 weights), 'compile' the default format with "
                        "torch_compile=True, 'float16+compile' a format compiled")
    p.add_argument("--compile", action="store_true", help="also run asyncinfer with torch_compile=True (= --formats compile)")
    p.add_argument("--int8", action="store_true",
                   help="also run asyncinfer with quantization='int8' (CPU; faster, not bit-exact)")
    p.add_argument("--device", default="cpu", help="asyncinfer's device (transformers baselines stay on the CPU)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of asyncinfer decode steps")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--json", type=Path, help="write all results to this JSON file")
    return p.parse_args(argv)


def say(message: str) -> None:
    """Progress line on stderr (the report goes to stdout)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# =========================================================================== transformers baselines

def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """Greedy ``generate()`` on left-padded ``prompts``; exactly ``new_tokens`` per row (EOS never stops it)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,  # as a keyword this disables the EOS stop (a GenerationConfig field would not)
            pad_token_id=pad_id,
        )
    generated = out[:, width:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"generate() made {generated.shape[1]} tokens, expected exactly {new_tokens}")
    return generated.tolist()


def run_hf_single(model: Any, workload: Workload, pad_id: int) -> tuple[SystemResult, dict[int, list[int]]]:
    """Each request alone through ``generate()``, one after another (batch 1, no padding)."""
    hf_generate(model, [list(workload.prompt_ids[0])], 4, pad_id)  # warm-up
    outputs: dict[int, list[int]] = {}
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompt_ids, workload.max_new_tokens)):
        outputs[i] = hf_generate(model, [list(prompt)], n, pad_id)[0]
    wall = time.perf_counter() - start
    result = SystemResult("HF generate(), one at a time", workload.num_requests, workload.total_output_tokens, wall)
    return result, outputs


def run_hf_static(
    model: Any, workload: Workload, batch_size: int, pad_id: int
) -> tuple[SystemResult, dict[int, list[int]]]:
    """Static batches in arrival order; each batch runs to its longest request, only useful tokens count."""
    hf_generate(model, [list(p) for p in workload.prompt_ids[:2]], 4, pad_id)  # warm-up
    outputs: dict[int, list[int]] = {}
    generated = 0
    start = time.perf_counter()
    for first in range(0, workload.num_requests, batch_size):
        idx = list(range(first, min(first + batch_size, workload.num_requests)))
        longest = max(workload.max_new_tokens[i] for i in idx)
        rows = hf_generate(model, [list(workload.prompt_ids[i]) for i in idx], longest, pad_id)
        generated += longest * len(idx)
        for i, row in zip(idx, rows):
            outputs[i] = row[: workload.max_new_tokens[i]]
    wall = time.perf_counter() - start
    notes = {"batch_size": batch_size, "generated_tokens_incl_waste": generated}
    result = SystemResult(f"HF generate(), static batch {batch_size}", workload.num_requests,
                          workload.total_output_tokens, wall, notes)
    return result, outputs


def hf_cb_configs(model: Any, workload: Workload, args: argparse.Namespace) -> tuple[Any, Any]:
    """Greedy GenerationConfig (EOS disabled with -1) and a ContinuousBatchingConfig sized like asyncinfer's."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(workload.max_new_tokens),
        eos_token_id=-1,  # the CB request state treats a negative id as "no EOS"
        pad_token_id=model.generation_config.pad_token_id,
    )
    page = args.hf_cb_page_size
    blocks_per_request = math.ceil(workload.max_seq_len / page)
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=args.max_num_seqs * blocks_per_request + 2,  # every running request fits: no eviction
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.max_num_seqs,
        auto_switch_to_flash=False,  # stay on sdpa (flash is CUDA-only anyway)
        seed=args.seed,
    )
    return gen, cb


def _collect_cb_results(manager: Any, request_ids: list[str]) -> dict[str, Any]:
    """Wait for every request id to finish; raise on a failed request or a dead loop."""
    pending = set(request_ids)
    results: dict[str, Any] = {}
    while pending:
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
            continue
        if out.request_id in pending and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"HF CB request {out.request_id} failed: {out.error}")
            results[out.request_id] = out
            pending.discard(out.request_id)
    return results


def run_hf_cb_manager(
    model: Any, workload: Workload, args: argparse.Namespace
) -> tuple[SystemResult, dict[int, list[int]]]:
    """transformers continuous batching with per-request ``max_new_tokens`` through its manager.

    ``generate_batch()`` is a thin wrapper over this same context manager; going one level down
    is the only way to give each request its own output length. The manager (KV cache, thread)
    is built and warmed up before the clock starts.
    """
    gen, cb = hf_cb_configs(model, workload, args)
    with torch.inference_mode(), model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=60
    ) as manager:
        warm = [manager.add_request(list(workload.prompt_ids[0]), request_id=f"warm{i}", max_new_tokens=4,
                                    eos_token_id=-1) for i in range(2)]
        _collect_cb_results(manager, warm)
        start = time.perf_counter()
        ids = [
            manager.add_request(list(p), request_id=f"bench{i}", max_new_tokens=n, eos_token_id=-1,
                                record_timestamps=True)
            for i, (p, n) in enumerate(zip(workload.prompt_ids, workload.max_new_tokens))
        ]
        results = _collect_cb_results(manager, ids)
        wall = time.perf_counter() - start
        resolved = manager.continuous_batching_config
    outputs = {i: list(results[rid].generated_tokens) for i, rid in enumerate(ids)}
    short = [i for i, toks in outputs.items() if len(toks) != workload.max_new_tokens[i]]
    if short:
        raise RuntimeError(f"HF CB returned the wrong number of tokens for requests {short[:8]}")
    ttft = [results[rid].timestamps[0] - start for rid in ids]
    e2e = [results[rid].lifespan[1] - start for rid in ids]
    notes = {
        "api": "ContinuousBatchingManager.add_request (per-request max_new_tokens)",
        "attn_implementation": model.config._attn_implementation,
        "page_size": resolved.page_size,
        "num_blocks": resolved.num_blocks,
        "max_batch_tokens": resolved.max_batch_tokens,
        "max_requests_per_batch": resolved.max_requests_per_batch,
        "ttft_s": latency_summary(ttft),
        "e2e_s": latency_summary(e2e),
    }
    result = SystemResult("HF continuous batching (sdpa)", workload.num_requests, workload.total_output_tokens,
                          wall, notes)
    return result, outputs


def run_hf_cb_generate_batch(
    model: Any, workload: Workload, args: argparse.Namespace
) -> tuple[SystemResult, dict[int, list[int]]]:
    """``model.generate_batch()``: one ``max_new_tokens`` (the workload's longest) for every request.

    Only each request's own length counts as output; setup of the manager is inside the timing
    because ``generate_batch`` builds and tears it down on every call.
    """
    gen, cb = hf_cb_configs(model, workload, args)
    longest = max(workload.max_new_tokens)
    with torch.inference_mode():
        model.generate_batch([list(workload.prompt_ids[0])] * 2, generation_config=gen,
                             continuous_batching_config=cb, max_new_tokens=4)  # warm-up
        start = time.perf_counter()
        results = model.generate_batch([list(p) for p in workload.prompt_ids], generation_config=gen,
                                       continuous_batching_config=cb, max_new_tokens=longest)
        wall = time.perf_counter() - start
    ordered = list(results.values())  # generate_batch returns them in input order
    if len(ordered) != workload.num_requests:
        raise RuntimeError(f"generate_batch returned {len(ordered)} of {workload.num_requests} results")
    outputs = {i: list(o.generated_tokens)[: workload.max_new_tokens[i]] for i, o in enumerate(ordered)}
    notes = {
        "api": "model.generate_batch (one max_new_tokens for all, useful tokens counted)",
        "attn_implementation": model.config._attn_implementation,
        "generated_tokens_incl_waste": sum(len(o.generated_tokens) for o in ordered),
    }
    result = SystemResult("HF generate_batch (CB, sdpa)", workload.num_requests, workload.total_output_tokens,
                          wall, notes)
    return result, outputs


def hf_single_decode_rate(model: Any, prompt: list[int], new_tokens: int, repeats: int, pad_id: int) -> dict:
    """Decode tok/s of one request: ``(n - 1) / (T(n) - T(1))``, medians of ``repeats`` runs."""
    def timed(n: int) -> float:
        start = time.perf_counter()
        hf_generate(model, [prompt], n, pad_id)
        return time.perf_counter() - start

    timed(4)  # warm-up
    t1 = statistics.median(timed(1) for _ in range(repeats))
    tn = statistics.median(timed(new_tokens) for _ in range(repeats))
    return {"t_1_s": t1, "t_n_s": tn, "decode_tokens_per_s": (new_tokens - 1) / (tn - t1)}


# =========================================================================== asyncinfer

def build_engine(
    model_path: Path, workload: Workload, args: argparse.Namespace, hf_config: Any, quantization: str = "auto"
) -> Any:
    """An AsyncEngine whose KV cache holds ``max_num_seqs`` requests of the workload's longest length.

    ``quantization``: "auto" (the engine's default format: on a CPU with ``--dtype float32``, the
    engine is given ``dtype="auto"``, which computes in float32, so that its default applies), a
    ``quantization=`` value, "float32" (``quantization=None``: float32 weights), "compile" (the
    default format with ``torch_compile=True``) or "<format>+compile"."""
    from asyncinfer import AsyncEngine

    compiled = quantization == "compile" or quantization.endswith("+compile")
    if compiled:
        quantization = quantization.removesuffix("compile").removesuffix("+") or "auto"
    dtype: str = args.dtype
    if quantization == "auto" and args.device == "cpu" and args.dtype == "float32":
        dtype = "auto"  # the same float32 activations; the engine picks its default weight format
    fmt: str | None = None if quantization == "float32" else quantization

    block = 16
    max_model_len = math.ceil((workload.max_seq_len + 1) / block) * block
    layers = hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_bytes_per_token = 2 * layers * hf_config.num_key_value_heads * head_dim * DTYPES[args.dtype].itemsize
    kv_cache_memory = int(args.max_num_seqs * max_model_len * kv_bytes_per_token * 1.1) + 16 * 2**20
    return AsyncEngine.from_pretrained(
        str(model_path),
        dtype=dtype,
        device=args.device,
        block_size=block,
        quantization=fmt,
        torch_compile=compiled,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        kv_cache_memory=kv_cache_memory,
        num_threads=args.threads,
        seed=args.seed,
    )


def _stats_snapshot(engine: Any) -> dict[str, Any]:
    """The engine core's cumulative counters now (differences give one run's figures)."""
    stats = engine.step_stats()
    return {
        "steps": stats.steps,
        "prefill_tokens": stats.prefill_tokens,
        "decode_tokens": stats.decode_tokens,
        "preemptions": stats.preemptions,
        "scheduled_requests": stats.scheduled_requests,
    }


async def _asyncinfer_generate_all(engine: Any, prompts: Any, lengths: Any) -> list[Any]:
    """Submit every request at once (``asyncio.gather``) and wait for all results, in order."""
    from asyncinfer import SamplingParams

    return await asyncio.gather(*(
        engine.generate(list(p), SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)
    ))


async def _asyncinfer_session(engine: Any, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, the timed workload and (optionally) the single-request decode test, in one engine run."""
    session: dict[str, Any] = {}
    async with engine:
        await _asyncinfer_generate_all(engine, workload.prompt_ids[:2], (4, 4))  # warm-up
        before = _stats_snapshot(engine)
        start = time.perf_counter()
        outs = await _asyncinfer_generate_all(engine, workload.prompt_ids, workload.max_new_tokens)
        session["wall_s"] = time.perf_counter() - start
        after = _stats_snapshot(engine)
        session["outputs"] = outs
        session["stats"] = {k: after[k] - before[k] for k in before}
        # step_stats().batch_sizes keeps the last 1024 steps only: the mean comes from the totals.
        run = session["stats"]
        run["mean_batch_size"] = run["scheduled_requests"] / run["steps"] if run["steps"] else 0.0
        if not args.skip_single_decode:
            session["single_decode"] = await engine_decode_rate(
                engine, list(workload.prompt_ids[0]), args.decode_tokens, args.repeats)
    return session


def run_asyncinfer(
    engine: Any, workload: Workload, args: argparse.Namespace, name: str = "asyncinfer"
) -> tuple[SystemResult, dict, dict | None]:
    """All requests through ``engine.generate`` at t=0; returns the result, outputs and single-decode figures."""
    session = asyncio.run(_asyncinfer_session(engine, workload, args))
    outs = session["outputs"]
    wrong = [i for i, o in enumerate(outs) if len(o.token_ids) != workload.max_new_tokens[i]]
    if wrong:
        raise RuntimeError(f"asyncinfer returned the wrong number of tokens for requests {wrong[:8]}")
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    e2e = [o.metrics.finish_time - o.metrics.arrival_time for o in outs]
    notes = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "kv_cache": engine.memory_plan.describe(),
        "engine_stats": session["stats"],
        "ttft_s": latency_summary(ttft),
        "e2e_s": latency_summary(e2e),
    }
    result = SystemResult(name, workload.num_requests, workload.total_output_tokens, session["wall_s"], notes)
    outputs = {i: list(o.token_ids) for i, o in enumerate(outs)}
    return result, outputs, session.get("single_decode")


def check_same_weights(engine: Any, hf_model: Any) -> dict[str, float] | str:
    """Max |difference| between a few asyncinfer and transformers weights (both dequantised from one file). The
    embedding is compared through its lookup, on about 1024 token ids spread over the vocabulary: in a block format
    it is kept in its file's blocks (``BlockEmbedding``), no float32 table to read."""
    try:
        model = engine.core.runner.model
        ours = dict(model.named_parameters())
        theirs = dict(hf_model.named_parameters())
        table = theirs["model.embed_tokens.weight"]
        ids = torch.arange(0, table.shape[0], max(1, table.shape[0] // 1024))
        with torch.no_grad():
            looked_up = model.embed_tokens(ids)
        pairs = {  # the projections are packed for oneDNN by default: their layout differs, not their values
            "embed_tokens": (looked_up, table[ids]),
            "layer0.input_norm": (ours["layers.0.input_norm.weight"], theirs["model.layers.0.input_layernorm.weight"]),
            "norm": (ours["norm.weight"], theirs["model.norm.weight"]),
        }
        with torch.no_grad():
            return {k: float((a.float().cpu() - b.float().cpu()).abs().max()) for k, (a, b) in pairs.items()}
    except (KeyError, AttributeError, RuntimeError) as exc:  # parameter names moved: not fatal
        return f"not checked ({type(exc).__name__}: {exc})"


# =========================================================================== profile

# The ops that run the weight projections, whatever the weight format (self CPU time).
PROJECTION_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise",
                            "quantized::linear_dynamic", "quantized::linear_dynamic_fp16",
                            "asyncinfer::gemm_q4_1", "asyncinfer::gemm_q8_0"})


def profile_decode_step(engine: Any, workload: Workload, batch: int, rows: int) -> dict[str, Any]:
    """torch.profiler table of one ``engine.core.step()`` with ``batch`` requests all decoding.

    Drives the synchronous core directly (the engine must not be running), then aborts the
    requests so their KV blocks return.
    """
    from torch.profiler import ProfilerActivity, profile

    from asyncinfer import SamplingParams
    from asyncinfer.request import Request

    core = engine.core
    requests = []
    for i in range(batch):
        prompt = list(workload.prompt_ids[i % workload.num_requests])
        room = engine.max_model_len - len(prompt)
        params = SamplingParams(max_tokens=max(1, min(64, room)), ignore_eos=True)  # >= 20: still running through the timed steps
        requests.append(Request(request_id=f"profile-b{batch}-{i}", prompt_token_ids=prompt, params=params,
                                arrival_time=time.time()))
    for r in requests:
        core.add_request(r)
    while any(r.num_output_tokens == 0 for r in requests):  # prefill everything
        core.step()
    core.step()  # one plain decode step before measuring
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        core.step()
        step_s = time.perf_counter() - start
    measured_batch = core.stats.batch_sizes[-1]
    context = sum(r.num_tokens for r in requests) / len(requests)
    fused = fused_layer_split(core) if measured_batch == batch else None  # still all decoding
    if fused is not None:
        fused["mean_context_tokens"] = context
        fused["all_decoding"] = all(b == batch for b in core.stats.batch_sizes[-fused["steps"]:])
    for r in requests:
        core.abort_request(r.request_id)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=rows)
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
    total = sum(e.self_cpu_time_total for e in averages)
    projections = sum(e.self_cpu_time_total for e in averages if e.key in PROJECTION_OPS)
    gather = sum(e.self_cpu_time_total for e in averages if e.key in ("aten::index", "aten::index_select"))
    if fused is not None:
        # The one-call layers are one op each here (asyncinfer::decode_layer): the kernels' own timing
        # (fused_layers) is the split to read, and the profiler's has no gather to name.
        gather = 0.0
    return {
        "batch": measured_batch,
        "step_s_profiled": step_s,
        "fused_layers": fused,
        # With the one-call step the profiler sees one op and no projection: the kernels' split stands in.
        "split": fused["split"] if fused is not None else {
            "projections": projections / total, "kv_gather": gather / total,
            "everything_else": 1 - projections / total} if total else {},
        "table": table,
        "top_ops": [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in top],
    }


def fused_layer_split(core: Any, steps: int = 16) -> dict[str, Any] | None:
    """For a model whose decode steps run on asyncinfer's kernels (the runner's decode backend is a
    ``KernelDecode``: the block formats): ``steps`` more decode steps, not under torch's profiler, with
    the kernels adding up their own time (the layers' projections, attention, the layers, the LM head;
    ``KernelDecode.stack``'s timing) and the step timed around ``core.step()``; the split is of their
    sums. None for other models."""
    from asyncinfer.models.decode_backends import KernelDecode

    decode = core.runner.decode
    if not isinstance(decode, KernelDecode):
        return None
    stack = decode.stack
    stack.time_parts(True)
    try:
        step_s = 0.0
        for _ in range(steps):
            start = time.perf_counter()
            core.step()
            step_s += time.perf_counter() - start
        layer_projections, attention, layers, head = stack.timing.tolist()
    finally:
        stack.time_parts(False)
    projections = layer_projections + head
    return {"steps": steps, "one_call": True, "step_s": step_s / steps,
            "layer_projections_s": layer_projections / steps, "head_s": head / steps, "attention_s": attention / steps,
            "layers_s": layers / steps, "split": {"projections": projections / step_s,
                                                  "attention": attention / step_s,
                                                  "everything_else": 1 - projections / step_s}}


# =========================================================================== llama.cpp

def run_llamacpp_peer(model_path: Path, workload: Workload, args: argparse.Namespace, results: dict,
                      outputs: dict, single: dict, record: dict) -> None:
    """llama.cpp on the same GGUF file and thread count, when llama-cpp-python is installed."""
    from llamacpp_peer import LlamaCppPeer, available

    why_not = available() or (None if model_path.suffix == ".gguf" else f"{model_path} is not a .gguf file")
    if why_not:
        say(f"llama.cpp skipped: {why_not}")
        record["llamacpp_skipped"] = why_not
        return
    threads = args.threads or torch.get_num_threads()
    n_ctx = math.ceil((workload.max_seq_len + 1) / 256) * 256
    say(f"running llama.cpp ({args.llamacpp_parallel} parallel sequences, {threads} threads)")
    peer = LlamaCppPeer(model_path, threads, args.llamacpp_parallel, n_ctx)
    try:
        peer.run([list(p) for p in workload.prompt_ids[:2]], [4, 4])  # warm-up
        tokens, wall, steps = peer.run([list(p) for p in workload.prompt_ids], list(workload.max_new_tokens))
        name = f"llama.cpp ({args.llamacpp_parallel} parallel, file's own quantization)"
        results["llamacpp"] = SystemResult(name, workload.num_requests, workload.total_output_tokens, wall,
                                           {"steps": steps, "n_parallel": args.llamacpp_parallel})
        outputs["llamacpp"] = tokens
        if not args.skip_single_decode:
            single["llama.cpp"] = peer.single_decode_rate(list(workload.prompt_ids[0]), args.decode_tokens,
                                                          args.repeats)
    finally:
        peer.close()


def run_paired_rounds(model_path: Path, workload: Workload, args: argparse.Namespace, hf_config: Any) -> dict | None:
    """``--paired-rounds``: asyncinfer's default format and llama.cpp on the workload, back to back, round
    after round (the order alternating, so that a drift of the machine's speed falls on both); each round
    a fresh engine (warmed up as in the main run) and llama.cpp's memory cleared. The machine's speed
    drifts between minutes far more than within one round, so the median of the rounds' own ratios is
    the comparison to quote. None when llama.cpp cannot run here."""
    from llamacpp_peer import LlamaCppPeer, available

    why_not = available() or (None if model_path.suffix == ".gguf" else f"{model_path} is not a .gguf file")
    if why_not:
        say(f"paired rounds skipped: {why_not}")
        return None
    threads = args.threads or torch.get_num_threads()
    n_ctx = math.ceil((workload.max_seq_len + 1) / 256) * 256
    quiet = argparse.Namespace(**{**vars(args), "skip_single_decode": True})
    prompts = [list(p) for p in workload.prompt_ids]
    lengths = list(workload.max_new_tokens)
    peer = LlamaCppPeer(model_path, threads, args.llamacpp_parallel, n_ctx)
    rounds = []
    try:
        on_own_thread(peer.run, prompts[:2], [4, 4])  # warm-up
        for index in range(args.paired_rounds):
            order = ("asyncinfer", "llama.cpp") if index % 2 == 0 else ("llama.cpp", "asyncinfer")
            walls: dict[str, float] = {}
            for system in order:
                say(f"paired round {index + 1}/{args.paired_rounds}: {system}")
                if system == "asyncinfer":
                    engine = build_engine(model_path, workload, quiet, hf_config)
                    walls[system] = on_own_thread(run_asyncinfer, engine, workload, quiet)[0].wall_s
                    del engine
                else:  # each run on a thread that ends with it, as every other system here
                    walls[system] = on_own_thread(peer.run, prompts, lengths)[1]
            tokens = workload.total_output_tokens
            rounds.append({"order": list(order), "asyncinfer_tokens_per_s": tokens / walls["asyncinfer"],
                           "llamacpp_tokens_per_s": tokens / walls["llama.cpp"],
                           "ratio": walls["llama.cpp"] / walls["asyncinfer"]})
    finally:
        peer.close()
    return {
        "rounds": rounds,
        "asyncinfer_median_tokens_per_s": statistics.median(r["asyncinfer_tokens_per_s"] for r in rounds),
        "llamacpp_median_tokens_per_s": statistics.median(r["llamacpp_tokens_per_s"] for r in rounds),
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "min_ratio": min(r["ratio"] for r in rounds),
        "max_ratio": max(r["ratio"] for r in rounds),
    }


# =========================================================================== roofline

def median_seconds(fn: Any, repeats: int, inner: int = 1) -> float:
    """Median seconds of one ``fn()`` call over ``repeats`` timings of ``inner`` calls (after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def square_gemm_flops(n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    with torch.inference_mode():
        seconds = median_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * n**3 / seconds


def linear_shapes(model: Any) -> Counter:
    """``Counter[(in_features, out_features)]`` of every nn.Linear in the model (lm_head included)."""
    return Counter((m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear))


def model_gemm_flops(shapes: Counter, batch: int, dtype: torch.dtype, repeats: int = 5) -> tuple[float, list]:
    """FLOP/s of the model's own linear layers at ``batch`` rows: all FLOPs / all time of one forward's GEMMs."""
    total_flops = 0.0
    total_s = 0.0
    per_shape = []
    with torch.inference_mode():
        for (k, n), count in sorted(shapes.items()):
            x = torch.randn(batch, k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype)
            flops = 2 * batch * k * n
            inner = max(1, int(2e8 // flops))  # about 0.2 GFLOP per timing
            seconds = median_seconds(functools.partial(torch.nn.functional.linear, x, w), repeats, inner=inner)
            per_shape.append({"shape": f"[{batch},{k}]x[{k},{n}]", "count": count, "gflops": flops / seconds / 1e9})
            total_flops += count * flops
            total_s += count * seconds
    return total_flops / total_s, per_shape


def model_dims(model: Any) -> dict[str, int]:
    """Matmul parameter counts and attention sizes needed by the FLOP formulas."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings().weight.numel()
    return {"layers": cfg.num_hidden_layers, "heads": heads, "head_dim": head_dim,
            "matmul_params": matmul, "lm_head_params": head}


def mean_decode_context(workload: Workload) -> float:
    """Mean keys attended per output token: output j (1-based) of a P-token prompt sees P + j - 1 keys."""
    total = sum(n * p + n * (n - 1) / 2 for p, n in zip(workload.prompt_lens, workload.max_new_tokens))
    return total / workload.total_output_tokens


def workload_flops(workload: Workload, dims: dict[str, int]) -> float:
    """FLOPs of the whole workload, prefill included (each token's forward, lm_head only where sampled)."""
    attn = 4 * dims["layers"] * dims["heads"] * dims["head_dim"]
    body = 2 * (dims["matmul_params"] - dims["lm_head_params"])
    head = 2 * dims["lm_head_params"]
    total = 0.0
    for p, n in zip(workload.prompt_lens, workload.max_new_tokens):
        processed = p + n - 1  # the last output token is never fed back
        total += processed * body + attn * processed * (processed + 1) / 2 + n * head
    return total


def roofline(model: Any, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Measured GEMM rates and the FLOPs per output token they imply a ceiling for."""
    dtype = DTYPES[args.dtype]
    dims = model_dims(model)
    ctx = mean_decode_context(workload)
    per_token = 2 * dims["matmul_params"] + 4 * dims["layers"] * dims["heads"] * dims["head_dim"] * ctx
    square = square_gemm_flops(args.gemm_size, dtype)
    batch = min(args.max_num_seqs, workload.num_requests)
    shaped, per_shape = model_gemm_flops(linear_shapes(model), batch, dtype)
    total = workload_flops(workload, dims)
    return {
        **dims,
        "formula": "FLOPs/token = 2 * matmul_params (lm_head included) + 4 * layers * heads * head_dim * ctx",
        "mean_decode_context": ctx,
        "flops_per_token": per_token,
        "workload_flops": total,
        "gemm_square": {"n": args.gemm_size, "flops_per_s": square},
        "gemm_model_shapes": {"batch": batch, "flops_per_s": shaped, "per_shape": per_shape},
        "roofline_tokens_per_s": square / per_token,
        "roofline_tokens_per_s_model_shapes": shaped / per_token,
        "workload_roofline_tokens_per_s": workload.total_output_tokens / (total / square),
    }


# =========================================================================== report

def ratio(a: SystemResult | None, b: SystemResult | None) -> float | None:
    if a is None or b is None:
        return None
    return a.tokens_per_s / b.tokens_per_s


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def print_header(workload: Workload, model_path: Path, args: argparse.Namespace, info: dict) -> None:
    s = workload.summary()
    print(f"model      {model_path}  ({args.dtype})")
    print(f"machine    {info['cpu']}; torch threads {info['torch_threads']}; "
          f"torch {info['torch']}, transformers {info['transformers']}")
    print(f"workload   {s['num_requests']} chat requests, seed {s['seed']}, all arriving at t=0; prompt tokens "
          f"{s['prompt_tokens_min']}-{s['prompt_tokens_max']} (mean {s['prompt_tokens_mean']:.1f}); output tokens "
          f"{s['output_tokens_min']}-{s['output_tokens_max']} (mean {s['output_tokens_mean']:.1f}, total "
          f"{s['output_tokens_total']}); EOS ignored")
    print()


def print_results(results: dict[str, SystemResult | None], total: int) -> None:
    print(f"{'system':<36}{'requests':>10}{'out tokens':>12}{'wall s':>10}{'tok/s':>10}")
    for r in results.values():
        if r is None:
            continue
        reqs = f"{r.num_requests}/{total}" if r.num_requests != total else str(r.num_requests)
        print(f"{r.name:<36}{reqs:>10}{r.output_tokens:>12}{r.wall_s:>10.2f}{r.tokens_per_s:>10.1f}")
        if "generated_tokens_incl_waste" in r.notes:
            print(f"{'':<36}(generated {r.notes['generated_tokens_incl_waste']} tokens, incl. those past each "
                  "request's own length)")
    print()


def print_latency(name: str, result: SystemResult | None) -> None:
    if result is None or "ttft_s" not in result.notes:
        return
    t, e = result.notes["ttft_s"], result.notes["e2e_s"]
    print(f"{name:<24} TTFT p50 {t['p50']:.2f} s  p99 {t['p99']:.2f} s   "
          f"e2e p50 {e['p50']:.2f} s  p99 {e['p99']:.2f} s")


def print_roofline(rf: dict[str, Any], ours: SystemResult | None) -> None:
    print(f"roofline   {rf['formula']}")
    print(f"           matmul params {rf['matmul_params'] / 1e6:.1f} M (lm_head {rf['lm_head_params'] / 1e6:.1f} M), "
          f"{rf['layers']} layers x {rf['heads']} heads x {rf['head_dim']}, mean decode context "
          f"{rf['mean_decode_context']:.1f} -> {rf['flops_per_token'] / 1e6:.1f} MFLOP/token")
    sq, ms = rf["gemm_square"], rf["gemm_model_shapes"]
    print(f"           GEMM {sq['n']}^3: {sq['flops_per_s'] / 1e9:.1f} GFLOP/s -> roofline "
          f"{rf['roofline_tokens_per_s']:.1f} tok/s")
    print(f"           model GEMM shapes at batch {ms['batch']}: {ms['flops_per_s'] / 1e9:.1f} GFLOP/s -> "
          f"{rf['roofline_tokens_per_s_model_shapes']:.1f} tok/s")
    print(f"           whole workload incl. prefill: {rf['workload_flops'] / 1e12:.2f} TFLOP -> "
          f"{rf['workload_roofline_tokens_per_s']:.1f} output tok/s at the {sq['n']}^3 GEMM rate")
    if ours is not None:
        print(f"           asyncinfer reaches {ours.tokens_per_s / rf['roofline_tokens_per_s']:.1%} of the roofline "
              f"({ours.tokens_per_s / rf['roofline_tokens_per_s_model_shapes']:.1%} of the model-shape one, "
              f"{ours.tokens_per_s / rf['workload_roofline_tokens_per_s']:.1%} of the workload one)")
    print()


# =========================================================================== main

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    model_path = resolve_model_path(args.model)
    dtype = DTYPES[args.dtype]
    say(f"loading the transformers reference from {model_path}")
    hf_model, tokenizer = on_own_thread(load_hf_reference, model_path, dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    workload = build_workload(tokenizer, args.num_requests, args.seed, args.min_new_tokens, args.max_new_tokens)
    info = machine_info()
    record: dict[str, Any] = {"machine": info, "model": str(model_path), "dtype": args.dtype,
                              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "workload": workload.summary()}
    print_header(workload, model_path, args, info)

    rf = None
    if not args.skip_roofline:
        say("measuring GEMM throughput")
        rf = on_own_thread(roofline, hf_model, workload, args)

    results: dict[str, SystemResult | None] = {"hf_single": None, "hf_static": None, "hf_cb": None, "asyncinfer": None}
    outputs: dict[str, dict[int, list[int]]] = {}
    single: dict[str, Any] = {}
    engine = None

    if not args.skip_asyncinfer:
        try:
            say("loading asyncinfer")
            engine = build_engine(model_path, workload, args, hf_model.config)
            record["asyncinfer_default_format"] = engine.config.quantization or str(engine.config.dtype)
            say(f"asyncinfer's default format here: {record['asyncinfer_default_format']}")
        except ImportError as exc:
            say(f"asyncinfer unavailable, skipped: {exc}")
            record["asyncinfer_error"] = repr(exc)
        if engine is not None:
            record["weights_max_abs_diff"] = on_own_thread(check_same_weights, engine, hf_model)
            say("running asyncinfer")
            results["asyncinfer"], outputs["asyncinfer"], ours_decode = run_asyncinfer(engine, workload, args)
            if ours_decode:
                single["asyncinfer"] = ours_decode

    formats = [f for f in args.formats.split(",") if f]
    if args.int8 and "int8" not in formats:
        formats.append("int8")
    if args.compile and "compile" not in formats:
        formats.append("compile")
    profiled_formats: dict[str, Any] = {}  # --profile: each format's engine, profiled at batch 1 below
    for fmt in formats if engine is not None else []:
        say(f"loading asyncinfer with quantization={fmt!r}")
        other = build_engine(model_path, workload, args, hf_model.config, quantization=fmt)
        seconds = other.model_info()[0].compile_seconds
        if seconds is not None:
            record.setdefault("compile_seconds", {})[fmt] = seconds
            say(f"asyncinfer {fmt}: torch.compile took {seconds:.1f} s at load")
        say(f"running asyncinfer {fmt}")
        key = f"asyncinfer_{fmt}"
        results[key], outputs[key], decode = run_asyncinfer(other, workload, args, name=f"asyncinfer {fmt}")
        if decode:
            single[key] = decode
        if args.profile:
            profiled_formats[fmt] = other
        del other

    if not args.skip_llamacpp:
        on_own_thread(run_llamacpp_peer, model_path, workload, args, results, outputs, single, record)

    paired = None
    if args.paired_rounds > 0 and (engine is None or args.skip_llamacpp):
        say("paired rounds skipped: they need asyncinfer's engine and llama.cpp (--skip-llamacpp was given "
            "or asyncinfer did not load)")
    elif args.paired_rounds > 0:
        paired = run_paired_rounds(model_path, workload, args, hf_model.config)

    if not args.skip_hf_cb:
        say(f"running transformers continuous batching ({args.hf_cb_api})")
        run_cb = run_hf_cb_manager if args.hf_cb_api == "manager" else run_hf_cb_generate_batch
        results["hf_cb"], outputs["hf_cb"] = on_own_thread(run_cb, hf_model, workload, args)

    if not args.skip_hf_static:
        say(f"running transformers static batches of {args.static_batch_size}")
        results["hf_static"], outputs["hf_static"] = on_own_thread(run_hf_static, hf_model, workload,
                                                                     args.static_batch_size, pad_id)

    if not args.skip_hf_single:
        subset = workload.head(min(args.hf_single_subset, workload.num_requests))
        say(f"running transformers one request at a time ({subset.num_requests} requests)")
        results["hf_single"], outputs["hf_single"] = on_own_thread(run_hf_single, hf_model, subset, pad_id)

    if not args.skip_single_decode:
        say(f"single-request decode, {args.decode_tokens} tokens (transformers)")
        single["transformers"] = on_own_thread(hf_single_decode_rate, hf_model, list(workload.prompt_ids[0]),
                                                args.decode_tokens, args.repeats, pad_id)

    profiles = []
    if args.profile and engine is not None:
        for batch in sorted({1, args.max_num_seqs}):
            say(f"profiling one asyncinfer decode step at batch {batch}")
            profiles.append(on_own_thread(profile_decode_step, engine, workload, batch, args.profile_rows))
            profiles[-1]["format"] = record.get("asyncinfer_default_format", "default")
        for fmt, other in profiled_formats.items():
            say(f"profiling one asyncinfer {fmt} decode step at batch 1")
            profiles.append(on_own_thread(profile_decode_step, other, workload, 1, args.profile_rows))
            profiles[-1]["format"] = fmt
        profiled_formats.clear()

    # ------------------------------------------------------------------ report
    print_results(results, workload.num_requests)
    ours = results["asyncinfer"]
    ratios = {
        "asyncinfer / HF continuous batching": ratio(ours, results["hf_cb"]),
        f"asyncinfer / HF static batch {args.static_batch_size}": ratio(ours, results["hf_static"]),
        "asyncinfer / HF single": ratio(ours, results["hf_single"]),
    }
    if results.get("llamacpp") is not None:
        ratios["asyncinfer / llama.cpp"] = ratio(ours, results["llamacpp"])
    for fmt in formats:
        key = f"asyncinfer_{fmt}"
        if results.get(key) is not None:
            ratios[f"asyncinfer {fmt} / HF continuous batching"] = ratio(results[key], results["hf_cb"])
            ratios[f"asyncinfer {fmt} / llama.cpp"] = ratio(results[key], results.get("llamacpp"))
            ratios[f"asyncinfer {fmt} / asyncinfer default"] = ratio(results[key], ours)
    for key in [k for k in single if k.startswith("asyncinfer")]:
        for peer in ("transformers", "llama.cpp"):
            if peer in single:
                ratios[f"single-request decode {key.replace('_', ' ')} / {peer}"] = (
                    single[key]["decode_tokens_per_s"] / single[peer]["decode_tokens_per_s"])
    for name, value in ratios.items():
        print(f"{name:<40} {fmt_ratio(value)}")
    for fmt, seconds in record.get("compile_seconds", {}).items():
        print(f"asyncinfer {fmt}: torch.compile at load {seconds:.1f} s")
    print()
    if single:
        parts = [f"{k} {v['decode_tokens_per_s']:.1f} tok/s" for k, v in single.items()]
        print(f"single-request decode ({args.decode_tokens} new tokens, (n-1)/(T(n)-T(1)), median of "
              f"{args.repeats}): " + ", ".join(parts))
    if paired is not None:
        per_round = ", ".join(f"{r['ratio']:.2f}x" for r in paired["rounds"])
        print(f"paired rounds ({len(paired['rounds'])}, asyncinfer default and llama.cpp back to back, the order "
              f"alternating): asyncinfer {paired['asyncinfer_median_tokens_per_s']:.1f} tok/s, llama.cpp "
              f"{paired['llamacpp_median_tokens_per_s']:.1f} (medians); asyncinfer / llama.cpp per round "
              f"{per_round}; median {paired['median_ratio']:.2f}x")
    print_latency("asyncinfer", ours)
    print_latency("HF continuous batching", results["hf_cb"])
    if ours is not None:
        st = ours.notes["engine_stats"]
        print(f"asyncinfer engine: {st['steps']} steps, mean batch {st['mean_batch_size']:.1f} requests, "
              f"{st['prefill_tokens']} prefill + {st['decode_tokens']} decode tokens, {st['preemptions']} preemptions")
        print(f"asyncinfer vs transformers weights, max |diff|: {record.get('weights_max_abs_diff')}")
    agreement = {k: token_agreement(outputs["asyncinfer"], v) for k, v in outputs.items()
                 if k != "asyncinfer" and "asyncinfer" in outputs}
    for name, a in agreement.items():
        if a.get("compared"):
            print(f"greedy tokens vs asyncinfer, {name}: {a['identical']}/{a['compared']} identical, "
                  f"mean common prefix {a['mean_common_prefix']:.1%}")
    print()
    if rf is not None:
        print_roofline(rf, ours)
    for prof in profiles:
        split = prof["split"]
        fused = prof.get("fused_layers")
        if not fused:
            print(f"profile: one asyncinfer ({prof['format']}) decode step at batch {prof['batch']} "
                  f"({prof['step_s_profiled'] * 1e3:.1f} ms under the profiler): projections "
                  f"{split['projections']:.0%}, everything else {split['everything_else']:.0%} (of which the K/V "
                  f"gather {split['kv_gather']:.0%}); top {args.profile_rows} by self CPU")
        else:
            op = "the whole step one asyncinfer::decode_stack op"
            print(f"profile: one asyncinfer ({prof['format']}) decode step at batch {prof['batch']} "
                  f"({prof['step_s_profiled'] * 1e3:.1f} ms under the profiler, {op}); top {args.profile_rows} "
                  f"by self CPU")
            f = fused["split"]
            print(f"  the same batch, {fused['steps']} more steps without the profiler (mean context "
                  f"{fused['mean_context_tokens']:.0f} tokens, {fused['step_s'] * 1e3:.2f} ms a step), timed by the "
                  f"kernels: projections {f['projections']:.1%} (layers {fused['layer_projections_s'] * 1e3:.2f} ms, "
                  f"LM head {fused['head_s'] * 1e3:.2f} ms), attention {f['attention']:.1%}, "
                  f"everything else {f['everything_else']:.1%}")
        print(prof["table"])

    record.update({
        "results": {k: (v.to_dict() if v is not None else None) for k, v in results.items()},
        "ratios": ratios,
        "single_request_decode": single,
        "token_agreement": agreement,
        "roofline": rf,
        "roofline_fraction": (ours.tokens_per_s / rf["roofline_tokens_per_s"]) if (ours and rf) else None,
        "profiles": profiles,
        "paired_rounds": paired,
    })
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, default=str))
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
