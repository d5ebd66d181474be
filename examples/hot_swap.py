"""Hot swap: replace a generator model while requests keep streaming, without a restart.

    python examples/hot_swap.py                  # swap the default model to a fresh copy of itself
    python examples/hot_swap.py /path/to/model   # swap to another model (HF directory or .gguf)

Three clients keep asking questions throughout (chat messages; plain text to a model
without a chat template, such as a base model's GGUF file). The new version loads in a worker
thread while the old one keeps answering; requests admitted before the switch
finish on the old version, later ones run on the new one, and the old version
is dropped once its last request ends. No request fails, even when the swap does
(a path that is no model): the old version serves on.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, SwapError

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 7 times 6?"]
OPTIONS = {"max_model_len": 1024, "kv_cache_memory": 64 * 2**20}


async def client(engine: AsyncEngine, stop: asyncio.Event, log: list[str]) -> None:
    i = 0
    while not stop.is_set():
        q = QUESTIONS[i % len(QUESTIONS)]
        try:
            out = await engine.generate([{"role": "user", "content": q}], SamplingParams(max_tokens=24))
        except InvalidParameterError as exc:  # a model without a chat template (a base model): ask in plain text
            if exc.parameter != "prompt":
                raise
            out = await engine.generate(f"Question: {q}\nAnswer:", SamplingParams(max_tokens=24))
        log.append(f"{time.strftime('%H:%M:%S')} {out.finish_reason:6} {q} -> {out.text.strip()[:50]!r}")
        i += 1


def show(engine: AsyncEngine, when: str) -> None:
    versions = ", ".join(f"v{v.version_id} {v.state} ({v.requests_in_flight} in flight)" for v in engine.model_info())
    print(f"[{when}] live versions: {versions}")


async def main(target: str | None) -> None:
    engine = await AsyncEngine.load(**OPTIONS)
    async with engine:
        stop = asyncio.Event()
        log: list[str] = []
        clients = [asyncio.create_task(client(engine, stop, log)) for _ in range(3)]
        await asyncio.sleep(2)
        show(engine, "before")
        start, served = time.perf_counter(), len(log)
        try:
            info = await engine.swap_model(target)  # the clients keep being served meanwhile
        except SwapError as exc:  # a path that is no model, say: the serving version was never touched
            print(f"swap failed, the serving version goes on: {exc}")
        else:
            print(f"swapped to v{info.version_id} ({info.source}) in {time.perf_counter() - start:.1f} s;"
                  f" {len(log) - served} requests finished while it loaded")
            show(engine, "just after")
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*clients)
        show(engine, "after")
    print(f"{len(log)} requests served, none failed:")
    print("\n".join(log[-6:]))


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the usage, not a model to swap to
        print(__doc__)
        sys.exit(0)
    flags = [arg for arg in sys.argv[1:] if re.match(r"--?[A-Za-z]", arg)]
    if flags:  # a flag was taken for the model to swap to, refused only after the first load (`--threads 1`)
        print(f"hot_swap.py: error: unrecognized argument {flags[0]!r}: this example takes a model to swap to only "
              "(set OMP_NUM_THREADS=1 for one thread; --help for the usage)", file=sys.stderr)
        sys.exit(2)
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else None))
