"""Pass 23: combinations of structured output, seeds, ``n > 1``, logprobs, stop strings and preemption.

Structured output needs a tokenizer, so these run on the HTTP tests' tiny chat model (float32: a row's
logits do not depend on its batch, docs/reliability.md "Seeded sampling depends on the request only").
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from asyncinfer import AsyncEngine, SamplingParams, StructuredOutput

from .conftest import TINY_OPTIONS

# 4-token blocks; the tiny Llama's KV is 512 bytes a token (2 layers x K,V x 2 heads x 16 dims x 4 bytes).
SMALL = {**TINY_OPTIONS, "block_size": 4, "max_model_len": 128}
TIGHT_KV = 40 * 4 * 512  # 40 blocks: samples of n > 1 and neighbours preempt each other

SPECS = {
    "regex": StructuredOutput.regex(r"[a-z ]{4,30}\."),
    "choice": StructuredOutput.choice(["Paris", "London", "Rome is far", "no"]),
    "json": StructuredOutput.json_schema({"type": "object", "properties": {"city": {"type": "string"},
                                          "n": {"type": "integer"}}, "required": ["city", "n"],
                                          "additionalProperties": False}),
    "lark": StructuredOutput.grammar('start: "x" ("y" | "zz")* "."'),
}


def params(kind: str, seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=1.3, top_p=0.97, seed=seed, n=n, logprobs=2,
                          stop=["ww", "o"] if kind == "regex" else None, structured=SPECS[kind])


PROMPT = "What is the capital of France? Paris is."


def tokens_of(out: Any) -> list[tuple[list[int], str, str | None]]:
    return [(o.token_ids, o.text, o.finish_reason) for o in out.outputs]


def test_seeded_structured_samples_with_logprobs_and_stops_are_the_same_alone_batched_and_preempted(
        tiny_chat_model: Path) -> None:
    """Each seed of each constrained request, asked alone on an idle engine, gives the tokens, text, finish
    reason and logprobs that its ``n = 3`` form gives on 40 KV blocks beside random neighbours (preemption,
    prefix hits, chunked prefills, other grammars in the same steps)."""

    async def alone() -> dict[tuple[str, int], Any]:
        found = {}
        for kind in SPECS:
            for seed in (40, 41, 42):
                engine = AsyncEngine.from_pretrained(tiny_chat_model, **SMALL)
                async with engine:
                    found[kind, seed] = await engine.generate(PROMPT, params(kind, seed))
        return found

    async def together() -> tuple[dict[str, Any], Any, Any]:
        rng = random.Random(23)
        engine = AsyncEngine.from_pretrained(tiny_chat_model, **{**SMALL, "kv_cache_memory": TIGHT_KV},
                                             max_num_batched_tokens=24, max_num_seqs=12)
        async with engine:
            async def neighbour() -> Any:
                await asyncio.sleep(rng.random() * 0.01)
                kind = rng.choice([*SPECS, None, None])
                return await engine.generate(
                    [rng.randrange(5, 300) for _ in range(rng.randrange(3, 30))],
                    SamplingParams(max_tokens=rng.randrange(4, 30), temperature=rng.choice([0.0, 0.9]),
                                   n=rng.choice([1, 2]), logprobs=rng.choice([None, 3]),
                                   structured=SPECS[kind] if kind else None, ignore_eos=kind is None))

            load = [asyncio.ensure_future(neighbour()) for _ in range(16)]
            groups = {kind: asyncio.ensure_future(engine.generate(PROMPT, params(kind, 40, n=3))) for kind in SPECS}
            done = {kind: await g for kind, g in groups.items()}
            await asyncio.gather(*load)
            return done, engine.step_stats(), engine.kv_stats()

    ref = asyncio.run(alone())
    got, stats, kv = asyncio.run(together())
    assert stats.preemptions > 0 and kv.prefix_hits > 0  # the hard cases happened
    for kind in SPECS:
        expected = [tokens_of(ref[kind, 40 + i])[0] for i in range(3)]
        assert tokens_of(got[kind]) == expected, kind
        for i, sample in enumerate(got[kind].outputs):
            want = ref[kind, 40 + i].outputs[0].logprobs
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in sample.logprobs] == \
                [(lp.token_id, [t for t, _ in lp.top]) for lp in want], kind
            # the logprobs are the same up to float32 rounding (a prefill cut into other chunks sums in another order)
            assert [lp.logprob for lp in sample.logprobs] == pytest.approx([lp.logprob for lp in want], abs=1e-5), kind
