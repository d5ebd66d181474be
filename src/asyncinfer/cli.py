"""The ``asyncinfer`` command.

    asyncinfer chat "What is the capital of France?"   # one-shot, streamed
    asyncinfer chat                                     # interactive; /reset clears history, /quit leaves
    asyncinfer info                                     # model, memory plan and options
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from asyncinfer.engine import AsyncEngine
from asyncinfer.errors import AsyncInferError
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "chat":
            return asyncio.run(_chat(args))
        return _info(args)
    except AsyncInferError as exc:
        print(f"asyncinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
