"""The default real model (SmolLM2-135M-Instruct, fp32) through the whole engine."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly, please, because I am in a hurry and need it fast.",
    "Give me a name for a pet turtle.",
]


@pytest.fixture(scope="module")
def engine_factory(real_gguf):
    def make(**kw):
        return AsyncEngine.from_pretrained(real_gguf, dtype="float32", device="cpu", max_model_len=1024,
                                           kv_cache_memory=256 * 2**20, **kw)
    return make


async def test_eight_prompts_batched_equal_transformers_greedy(engine_factory, real_hf_reference) -> None:
    hf, tok = real_hf_reference
    engine = engine_factory()
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    async with engine:
        outs = await asyncio.gather(*(engine.generate(c, SamplingParams(max_tokens=48, ignore_eos=True))
                                      for c in chats))
    assert max(engine.step_stats().batch_sizes) == len(QUESTIONS)
    for chat, out in zip(chats, outs):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = tok.encode(ids, add_special_tokens=False)
        assert out.prompt_token_ids == prompt
        x = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, min_new_tokens=48,
                              do_sample=False, eos_token_id=None)
        assert out.token_ids == ref[0, len(prompt):].tolist()
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


async def test_chat_answer_stops_at_eos_and_streams_text(engine_factory) -> None:
    engine = engine_factory()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    async with engine:
        out = await engine.generate(chat, SamplingParams(max_tokens=64))
        pieces = [d async for d in engine.stream(chat, SamplingParams(max_tokens=64))]
    assert out.finish_reason == "stop" and "Paris" in out.text
    assert out.token_ids[-1] == engine.tokenizer.eos_token_id
    assert "".join(p.text for p in pieces) == out.text
    assert pieces[-1].finish_reason == "stop"


async def test_stop_string_is_never_shown(engine_factory) -> None:
    engine = engine_factory()
    chat = [{"role": "user", "content": "Write a short story about a cat who learns to fly."}]
    async with engine:
        full = await engine.generate(chat, SamplingParams(max_tokens=60))
        # A stop string taken from the middle of the answer, across token boundaries.
        stop = full.text[25:31]
        first = full.text.index(stop)
        streamed = [d async for d in engine.stream(chat, SamplingParams(max_tokens=60, stop=[stop]))]
        kept = await engine.generate(chat, SamplingParams(max_tokens=60, stop=[stop], include_stop_str_in_output=True))
    text = "".join(d.text for d in streamed)
    assert text == full.text[:first]
    assert streamed[-1].finish_reason == "stop"
    # No delta ever showed a piece of the stop string that was later taken back.
    shown = ""
    for d in streamed:
        shown += d.text
        assert full.text.startswith(shown) and stop not in shown
    assert kept.text == full.text[: first + len(stop)] and kept.stop_reason == stop


async def test_huge_text_prompts_never_stall_the_callers_loop(engine_factory) -> None:
    engine = engine_factory()
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t0 - 0.005)

    # The suite's own objects out of the cyclic collector's way: a full collection of a long test
    # session's heap can pause the loop by itself, which is not the engine's doing (a full CI run
    # once saw a 175 ms stall here; this test alone sees 4-13 ms).
    gc.freeze()
    try:
        await _huge_prompts(engine, ticker, stop)
    finally:
        gc.unfreeze()
    assert max(lags) < 0.1, f"the caller's loop stalled {max(lags) * 1e3:.0f} ms"


async def _huge_prompts(engine, ticker, stop) -> None:
    async with engine:
        tick = asyncio.create_task(ticker())
        # 2 MB: more characters than 1024 tokens of this vocabulary can hold, refused untokenized.
        t0 = time.perf_counter()
        with pytest.raises(InvalidParameterError, match="characters"):
            await engine.generate("word " * 400_000, SamplingParams(max_tokens=4))
        assert time.perf_counter() - t0 < 1.0
        # Short enough to be worth tokenizing, too long in tokens: tokenized off the loop, then refused.
        with pytest.raises(InvalidParameterError, match="max_model_len"):
            await engine.generate("word " * 6_000, SamplingParams(max_tokens=4))
        with pytest.raises(InvalidParameterError, match="max_model_len"):
            await engine.generate([{"role": "user", "content": "word " * 6_000}], SamplingParams(max_tokens=4))
        text = "word " * 900  # 4500 characters (tokenized off the loop), 900 tokens: fits max_model_len 1024
        out = await engine.generate(text, SamplingParams(max_tokens=4, ignore_eos=True))
        assert out.prompt_token_ids == engine.tokenizer.encode(text) and len(out.token_ids) == 4
        stop.set()
        await tick
