"""Quickstart: chat with the default model (SmolLM2-135M-Instruct) through asyncinfer.

    python examples/quickstart.py                       # a few questions, answered concurrently
    python examples/quickstart.py "Tell me a joke"      # your own question, streamed

The first run fetches the model (~93 MB) into the user cache directory.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time

from asyncinfer import AsyncEngine, SamplingParams


async def main(question: str | None) -> None:
    engine = await AsyncEngine.load(max_model_len=2048)
    async with engine:
        if question:
            # Streaming: print text as it is generated.
            async for delta in engine.stream([{"role": "user", "content": question}], SamplingParams(max_tokens=200)):
                print(delta.text, end="", flush=True)
            print()
            return
        # Concurrency: these requests share every forward pass (continuous batching).
        questions = [
            "What is the capital of France?",
            "Name three primary colours.",
            "Write a haiku about the sea.",
            "What is 12 times 12?",
        ]
        start = time.perf_counter()
        outputs = await asyncio.gather(
            *(engine.generate([{"role": "user", "content": q}], SamplingParams(max_tokens=64)) for q in questions)
        )
        elapsed = time.perf_counter() - start
        for q, out in zip(questions, outputs):
            print(f"Q: {q}\nA: {out.text.strip()}  [{out.num_output_tokens} tokens, {out.finish_reason}]\n")
        total = sum(o.num_output_tokens for o in outputs)
        print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s across {len(outputs)} requests)")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the usage, not a question
        print(__doc__)
        sys.exit(0)
    flags = [arg for arg in sys.argv[1:] if re.match(r"--?[A-Za-z]", arg)]
    if flags:  # a flag (the commands' thread count, say) was asked as the question once the model had loaded
        print(f"quickstart.py: error: unrecognized argument {flags[0]!r}: this example takes a question only "
              "(set OMP_NUM_THREADS=1 for one thread; --help for the usage)", file=sys.stderr)
        sys.exit(2)
    asyncio.run(main(" ".join(sys.argv[1:]) or None))
