"""``batch_invariant=True``: a text's vector depends on the text alone, bit for bit, whatever shares its batch.
In one pass of the whole batch, the matrix products' blocking follows the batch's token count and the attention's
and pooling's sums its longest text, so a vector moved in its last bits (about 1e-7) with its neighbours' count and
lengths: a caller could read from its own vectors that other callers' texts were batched with it, and how long."""

from __future__ import annotations

import asyncio

import torch

from asyncinfer import AsyncEngine

MINE = "The quick brown fox jumps over the lazy dog."
OTHERS = ["hi", "a somewhat longer sentence about the weather in spring and the flowers that come with it " * 3,
          "one two three", "x " * 100]


async def vectors(minilm_dir, batch_invariant: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``MINE`` alone, then batched with each mix of others (in one call, and beside other tenants' calls)."""
    engine = await AsyncEngine.load(minilm_dir, device="cpu", dtype="float32", batch_invariant=batch_invariant,
                                    max_wait_ms=50)
    async with engine:
        alone = (await engine.embed(MINE))[0]
        mixed = [(await engine.embed([*OTHERS[:k], MINE]))[-1] for k in range(1, len(OTHERS) + 1)]
        calls = [engine.embed(MINE, tenant="me"), *(engine.embed(text, tenant=f"t{i}") for i, text in enumerate(OTHERS))]
        mixed.append((await asyncio.gather(*calls))[0][0])
        assert engine.embedding_stats().num_batches < 1 + len(OTHERS) + 1 + len(OTHERS)  # the last calls shared one
    return alone, mixed


def test_a_batch_invariant_encoders_vector_is_the_texts_alone(minilm_dir) -> None:
    alone, mixed = asyncio.run(vectors(minilm_dir, batch_invariant=True))
    assert all(torch.equal(vector, alone) for vector in mixed)
    batched_alone, batched = asyncio.run(vectors(minilm_dir, batch_invariant=False))
    assert torch.equal(batched_alone, alone)  # one text alone: the same pass either way
    for vector in batched:  # batched, the same up to float rounding
        torch.testing.assert_close(vector, alone, rtol=0, atol=1e-5)


def test_a_batch_invariant_encoders_plan_counts_one_text_a_pass(minilm_dir) -> None:
    """Its passes hold one text each, so its largest is one text of ``max_seq_len``: the plan counted the batched
    encoder's (8 texts of 256 tokens, 84.0 MiB), and refused, as not fitting, options whose batches it never runs
    (1024 texts of 512 tokens: 33 GiB of activations counted, 21 MiB used)."""
    batched = AsyncEngine.plan_memory(minilm_dir, dtype="float32")
    plan = AsyncEngine.plan_memory(minilm_dir, dtype="float32", batch_invariant=True)
    one = AsyncEngine.plan_memory(minilm_dir, dtype="float32", max_batch_size=1)
    assert batched.largest_batch == (8, 256)
    assert plan.largest_batch == (1, 256) and plan.activation_bytes == one.activation_bytes
    assert plan.describe() == "weights 86.1 MiB, activations 10.5 MiB (batch 1 x 256 tokens)"
    big = {"max_batch_size": 1024, "max_batch_tokens": 2**20, "max_seq_len": 512}
    wide = AsyncEngine.plan_memory(minilm_dir, dtype="float32", batch_invariant=True, available_bytes=2**30, **big)
    assert wide.largest_batch == (1, 512) and wide.total_bytes < 2**30


def test_a_batch_invariant_encoder_counts_no_padding(minilm_dir) -> None:
    """Each text runs alone at its own length, so the tokens computed are the real ones: ``num_padded_tokens``
    counted each batch as padded to its longest text (here 14 tokens, 22 'padded', for no padding computed)."""
    async def stats(batch_invariant: bool):
        engine = await AsyncEngine.load(minilm_dir, device="cpu", dtype="float32", batch_invariant=batch_invariant)
        async with engine:
            await engine.embed(["hi", "a somewhat longer sentence about the weather in spring"])
            return engine.embedding_stats()
    invariant, batched = asyncio.run(stats(True)), asyncio.run(stats(False))
    assert invariant.num_batches == batched.num_batches == 1 and invariant.num_tokens == batched.num_tokens
    assert invariant.num_padded_tokens == invariant.num_tokens
    assert batched.num_padded_tokens == 2 * 11 > batched.num_tokens  # 'hi' padded to the other's 11 tokens
