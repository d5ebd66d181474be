"""The ``asyncinfer`` command.

    asyncinfer chat "What is the capital of France?"   # one-shot, streamed
    asyncinfer chat                                     # interactive; /reset clears history, /quit leaves
    asyncinfer info                                     # model, memory plan and options
    asyncinfer plan MODEL --batch 8 --seq-len 4096 --device-memory 24GiB   # the budget, no weights loaded
    asyncinfer embed "first text" "second text"         # sentence embeddings (all-MiniLM-L6-v2)
    asyncinfer lab --synthetic 200                      # compare schedulers on a simulated trace
    asyncinfer serve MODEL --port 8000                  # an OpenAI-compatible HTTP server (asyncinfer[server])
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from asyncinfer.engine import AsyncEngine
from asyncinfer.errors import AsyncInferError, InvalidParameterError
from asyncinfer.sampling_params import SamplingParams


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": args.dtype, "device": args.device}
    if args.max_model_len is not None:
        options["max_model_len"] = args.max_model_len
    if args.kv_cache_memory is not None:
        options["kv_cache_memory"] = args.kv_cache_memory
    return options


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes")


async def _chat(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    engine = AsyncEngine.from_pretrained(args.model, **_engine_options(args))
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    async with engine:
        if args.prompt:
            await _answer(engine, history, " ".join(args.prompt), params, args.stats)
            return 0
        print("asyncinfer chat — /reset clears the history, /quit (or Ctrl-D) leaves.", file=sys.stderr)
        while True:
            try:
                line = await asyncio.to_thread(input, "> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if line.strip() in ("/quit", "/exit"):
                return 0
            if line.strip() == "/reset":
                del history[1 if args.system else 0 :]
                continue
            if line.strip():
                await _answer(engine, history, line, params, args.stats)


async def _answer(
    engine: AsyncEngine, history: list[dict[str, str]], text: str, params: SamplingParams, stats: bool
) -> None:
    history.append({"role": "user", "content": text})
    pieces: list[str] = []
    start = time.perf_counter()
    first: float | None = None
    n = 0
    async for delta in engine.stream(history, params):
        if first is None and delta.token_ids:
            first = time.perf_counter()
        n += len(delta.token_ids)
        pieces.append(delta.text)
        print(delta.text, end="", flush=True)
        if delta.finish_reason is not None:
            reason = delta.finish_reason
    print()
    history.append({"role": "assistant", "content": "".join(pieces)})
    if stats and first is not None:
        total = time.perf_counter() - start
        decode = (n - 1) / (total - (first - start)) if n > 1 and total > first - start else 0.0
        print(
            f"[{n} tokens, finish={reason}, TTFT {1000 * (first - start):.0f} ms, decode {decode:.1f} tok/s]",
            file=sys.stderr,
        )


def _info(args: argparse.Namespace) -> int:
    engine = AsyncEngine.from_pretrained(args.model, **_engine_options(args))
    mc = engine.model_config
    print(f"model: {engine.model_source}")
    print(f"architecture: {mc.architecture}, {mc.num_layers} layers, hidden {mc.hidden_size}, "
          f"heads {mc.num_heads}/{mc.num_kv_heads} kv, vocab {mc.vocab_size}")
    print(f"device: {engine.config.device}, dtype: {engine.config.dtype}")
    print(f"memory plan: {engine.memory_plan.describe()}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from asyncinfer.memory import read_model_config
    from asyncinfer.model_source import resolve_model
    from asyncinfer.planner import parse_bytes, plan_deployment

    path = resolve_model(args.model_arg or args.model)
    plan = plan_deployment(
        read_model_config(path), model_name=path.name, batch=args.batch, seq_len=args.seq_len, device=args.device,
        dtype=args.dtype, quantization=args.quantization, block_size=args.block_size,
        device_memory=None if args.device_memory is None else parse_bytes(args.device_memory),
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
    )
    print(plan.table())
    return 0 if plan.fits else 1


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory, .gguf file or known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="the model (same as MODEL)")
    p.add_argument("--batch", type=int, default=1, help="requests served at once (default 1)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per request, prompt + output (default: the model's context)")
    p.add_argument("--dtype", default="auto",
                   help="auto (float32 on cpu, bfloat16 on cuda) | float32 | bfloat16 | float16")
    p.add_argument("--quantization", default=None, choices=("int8",), help="int8 weights (cpu, float32)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the target device (default cpu)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="e.g. 24GiB or 80GB (default: measured here: available RAM, or the CUDA device's total)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the engine's block_size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per step (for activations)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="requests per step (for the logits)")


def _parse_options(items: list[str]) -> dict[str, dict[str, Any]]:
    """``NAME.KEY=VALUE`` pairs (VALUE read as JSON, else kept as text) -> per-scheduler options."""
    options: dict[str, dict[str, Any]] = {}
    for item in items:
        target, sep, raw = item.partition("=")
        name, dot, key = target.rpartition(".")
        if not (sep and dot and name and key):
            raise InvalidParameterError("--option", item, "NAME.KEY=VALUE, e.g. pd-split.prefill_budget=64")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        options.setdefault(name, {})[key] = value
    return options


def _lab(args: argparse.Namespace) -> int:
    from asyncinfer import lab
    from asyncinfer.schedulers import SchedulerConfig

    if args.calibrate:
        from asyncinfer.lab.calibrate import calibrate

        command = f"asyncinfer lab --calibrate {args.calibrate}" + (f" --model {args.model}" if args.model else "")
        command += f" --threads {args.threads}" if args.threads else ""
        model = calibrate(args.model, command=command, num_threads=args.threads)
        model.save(args.calibrate)
        print(f"cost model written to {args.calibrate}: {model.coefficients}")
        print(f"fit over {model.meta['fit_samples']} shapes: mean relative error "
              f"{model.meta['fit_mean_rel_error']:.1%}, max {model.meta['fit_max_rel_error']:.1%}")
        return 0
    if args.trace:
        trace = lab.load_trace(args.trace)
        source = args.trace
    else:
        trace = lab.synthetic_trace(args.synthetic, rate=args.rate, seed=args.seed,
                                    long_fraction=args.long_fraction, priorities=args.priorities)
        source = f"synthetic: {args.synthetic} requests, {args.rate}/s, seed {args.seed}"
    if args.save_trace:
        lab.save_trace(trace, args.save_trace)
    names = [n.strip() for n in args.schedulers.split(",") if n.strip()]
    options = _parse_options(args.option)
    cost = lab.load_cost_model(args.cost_model)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=args.max_model_len)
    slo = lab.Slo(ttft=args.slo_ttft, tpot=args.slo_tpot)
    results, summaries = {}, []
    for name in names:
        result = lab.simulate(trace, name, cost_model=cost, config=config, num_blocks=args.num_blocks,
                              block_size=args.block_size, options=options.get(name),
                              enable_prefix_caching=not args.no_prefix_caching)
        results[name] = result.records
        summaries.append(lab.summarize(name, result.records, slo))
    print(f"trace: {source} ({len(trace)} requests, {sum(t.prompt_len for t in trace)} prompt and "
          f"{sum(t.output_len for t in trace)} output tokens)")
    print(f"cost model: {args.cost_model or 'shipped'} ({cost.meta.get('model', '?')}, "
          f"{cost.meta.get('cpu', '?')}); {args.num_blocks} blocks x {args.block_size}, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}")
    print(f"SLO: TTFT <= {slo.ttft}s and TPOT <= {slo.tpot}s; times in simulated seconds\n")
    print(lab.format_table(summaries))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"trace": source, "summaries": [s.to_dict() for s in summaries]}, fh, indent=2)
    if args.plot:
        if lab.save_plot(results, summaries, args.plot, title=source):
            print(f"\nplot saved to {args.plot}")
        else:
            print("\nno plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _add_lab_args(p: argparse.ArgumentParser) -> None:
    from asyncinfer.schedulers import builtin_schedulers

    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, help="JSONL trace: arrival, prompt_len, output_len[, priority, id]")
    src.add_argument("--synthetic", type=_positive_int, default=200, metavar="N", help="generate N requests (default 200)")
    p.add_argument("--rate", type=float, default=0.25, help="synthetic arrivals per second (Poisson)")
    p.add_argument("--seed", type=int, default=0, help="synthetic trace seed")
    p.add_argument("--long-fraction", type=float, default=0.2, help="synthetic share of long prompts (512-2048)")
    p.add_argument("--priorities", type=_int_list, default=(0, 2, 4), help="synthetic priority levels, e.g. 0,2,4")
    p.add_argument("--save-trace", default=None, metavar="FILE", help="write the trace used as JSONL")
    p.add_argument("--schedulers", default=",".join(builtin_schedulers()), help="comma-separated names")
    p.add_argument("--option", action="append", default=[], metavar="NAME.KEY=VALUE",
                   help="a scheduler option, e.g. pd-split.prefill_budget=64 (repeatable)")
    p.add_argument("--cost-model", default=None, metavar="FILE", help="cost model JSON (default: the shipped one)")
    p.add_argument("--num-blocks", type=_positive_int, default=4096)
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true", help="simulate the engine with prefix caching off")
    # Limits that suit the shipped CPU cost model (a 64-request decode step costs seconds there).
    p.add_argument("--max-num-seqs", type=_positive_int, default=16)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=512)
    p.add_argument("--max-model-len", type=_positive_int, default=4096)
    p.add_argument("--slo-ttft", type=float, default=5.0, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="TPOT SLO in seconds")
    p.add_argument("--plot", default="scheduler_lab.png", help="PNG path ('' for none)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the per-policy figures as JSON")
    p.add_argument("--calibrate", default=None, metavar="OUT",
                   help="time the real runner of --model, write a cost model JSON to OUT, and exit")
    p.add_argument("--model", default=None, help="model to calibrate (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads while calibrating")


async def _embed(args: argparse.Namespace) -> int:
    options = {"device": args.device, "dtype": args.dtype}
    async with AsyncEngine.from_pretrained(args.model, name="embed", **options) as engine:
        vectors = await engine.embed(args.texts)
        (info,) = engine.model_info()
    if args.json:
        print(json.dumps({"model": info.source, "texts": args.texts, "embeddings": vectors.tolist()}))
        return 0
    print(f"model: {info.source} ({vectors.shape[1]} dimensions)")
    width = max(len(t) for t in args.texts[:20])
    print("cosine similarity:")
    similarity = vectors @ vectors.T if vectors.shape[0] > 1 else None
    for i, text in enumerate(args.texts):
        head = " ".join(f"{v:+.3f}" for v in vectors[i, :4].tolist())
        row = "" if similarity is None else "  " + " ".join(f"{x:5.2f}" for x in similarity[i].tolist())
        print(f"  {text[:60]:<{min(width, 60)}}  [{head} ...]{row}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from asyncinfer.server import ModelSpec, ServerSettings, api_keys_from_env, create_app, run_server
    except ImportError as exc:
        print(f"asyncinfer: error: {exc.name} is missing: pip install 'asyncinfer[server]'", file=sys.stderr)
        return 2
    model = args.model_arg or args.model
    options = _engine_options(args)
    if args.scheduler is not None:
        options["scheduler"] = args.scheduler
    specs = [ModelSpec(model, args.served_model_name or ModelSpec.served_name(model), options)]
    if args.embedding_model:
        specs.append(ModelSpec(args.embedding_model, ModelSpec.served_name(args.embedding_model),
                               {"device": args.device}))
    for spec in specs:  # a bad path or option fails here, in a line, not in the server's start-up log
        AsyncEngine.plan_memory(spec.model, **spec.options)
    settings = ServerSettings(api_keys=(*api_keys_from_env(), *args.api_key), max_body_bytes=args.max_body_bytes,
                              cache_isolation=args.cache_isolation, tenant_header=args.tenant_header)
    run_server(create_app(specs, settings), args.host, args.port, args.log_level)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    _add_engine_args(p)
    p.add_argument("--served-model-name", default=None, help="its name in requests (default: file or dir name)")
    p.add_argument("--embedding-model", default=None, help="also serve this sentence encoder on /v1/embeddings")
    p.add_argument("--scheduler", default=None, help="fifo | length-bucket | aging-priority | pd-split | ...")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted bearer key (repeatable; ASYNCINFER_API_KEY adds comma-separated ones)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--cache-isolation", default="off", choices=("off", "api-key", "header"),
                   help="share cached prompt prefixes only within one API key or one tenant header value")
    p.add_argument("--tenant-header", default="x-tenant-id", help="the header --cache-isolation header reads")
    p.add_argument("--log-level", default="info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncinfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="chat with a model (one-shot with a prompt, interactive without)")
    chat.add_argument("prompt", nargs="*", help="one-shot prompt; omit for an interactive session")
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--stats", action="store_true", help="print token count, TTFT and decode speed")
    _add_engine_args(chat)
    info = sub.add_parser("info", help="load a model and print its memory plan")
    _add_engine_args(info)
    plan = sub.add_parser("plan", help="print the memory budget of a deployment from the config alone (no weights)")
    _add_plan_args(plan)
    embed = sub.add_parser("embed", help="embed texts with a sentence encoder and print their cosine similarities")
    embed.add_argument("texts", nargs="+", help="texts to embed")
    embed.add_argument("--model", default="all-MiniLM-L6-v2", help="sentence encoder (name or directory)")
    embed.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    embed.add_argument("--device", default="auto", help="auto | cpu | cuda")
    embed.add_argument("--json", action="store_true", help="print the vectors as JSON")
    lab = sub.add_parser("lab", help="replay a request trace through schedulers in simulated time (no model)")
    _add_lab_args(lab)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (asyncinfer[server])")
    _add_serve_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "chat":
            return asyncio.run(_chat(args))
        if args.command == "lab":
            return _lab(args)
        if args.command == "embed":
            return asyncio.run(_embed(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "plan":
            return _plan(args)
        return _info(args)
    except AsyncInferError as exc:
        print(f"asyncinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
