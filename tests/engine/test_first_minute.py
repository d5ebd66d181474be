"""The default model, as a new user meets it: loaded off the event loop, token counts, chat history
trimmed to a budget, and no U+FFFD when max_tokens cuts a character."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, trim_messages

pytestmark = pytest.mark.real_model

ROBOT = [{"role": "user", "content": "Reply with three emojis that describe a happy robot."}]


async def test_load_keeps_the_event_loop_running(real_gguf) -> None:
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    start = time.perf_counter()
    engine = await AsyncEngine.load(real_gguf, max_model_len=512)
    elapsed = time.perf_counter() - start
    task.cancel()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 10 and max(gaps) < max(1.0, elapsed / 4)  # the loop kept running through the load
    async with engine:
        out = await engine.generate("The capital of France is", SamplingParams(max_tokens=3))
    assert out.text.strip().startswith("Paris")


async def test_count_tokens_is_what_generate_sends(real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=512) as engine:
        tok = engine.tokenizer
        text = "Émoji 🤖 and 中文"
        assert engine.count_tokens(text) == len(tok.encode(text))
        rendered = tok.apply_chat_template(ROBOT, add_generation_prompt=True, tokenize=False)
        assert engine.count_tokens(ROBOT) == len(tok.encode(rendered, add_special_tokens=False))
        out = await engine.generate(ROBOT, SamplingParams(max_tokens=1))
        assert len(out.prompt_token_ids) == engine.count_tokens(ROBOT) == engine.count_tokens(out.prompt_token_ids)
        with pytest.raises(InvalidParameterError) as err:
            engine.count_tokens("")
        assert err.value.parameter == "prompt"

        history = [{"role": "system", "content": "You are terse."}]
        for i in range(12):
            history += [{"role": "user", "content": f"Question {i}: " + "why? " * 10},
                        {"role": "assistant", "content": f"Answer {i}."}]
        history.append({"role": "user", "content": "And finally?"})
        budget = 200
        kept = trim_messages(history, budget, engine.count_tokens)
        assert kept[0] == history[0] and kept[-1] == history[-1] and kept[1]["role"] == "user"
        one_more_turn = [kept[0], *history[-len(kept) - 1:]]  # the user + assistant pair before the kept ones
        assert engine.count_tokens(kept) <= budget < engine.count_tokens(one_more_turn)
        reply = await engine.generate(kept, SamplingParams(max_tokens=engine.max_model_len - budget))
        assert reply.finish_reason in ("stop", "length")


async def test_a_character_cut_by_max_tokens_is_dropped_not_replaced(real_gguf) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=512) as engine:
        tok = engine.tokenizer
        full = await engine.generate(ROBOT, SamplingParams(max_tokens=8))
        cuts = [k for k in range(1, 8) if tok.decode(full.token_ids[:k]).endswith("\ufffd")]
        assert cuts, "the greedy reply no longer splits an emoji over tokens: pick another prompt"
        for k in (cuts[0], cuts[-1], 8):
            out = await engine.generate(ROBOT, SamplingParams(max_tokens=k))
            assert out.token_ids == full.token_ids[:k] and "\ufffd" not in out.text
            assert out.text == tok.decode(out.token_ids).rstrip("\ufffd")
            deltas = [d async for d in engine.stream(ROBOT, SamplingParams(max_tokens=k))]
            assert "".join(d.text for d in deltas) == out.text and deltas[-1].finish_reason == "length"


def test_a_load_parses_the_gguf_header_once(real_gguf, monkeypatch) -> None:
    """One pass over the header (our reader), never gguf's full GGUFReader (seconds for a vocabulary)."""
    import gguf

    from asyncinfer.models import gguf_file

    parses: list[str] = []
    real_parse = gguf_file.GGUFFile._parse
    monkeypatch.setattr(gguf_file.GGUFFile, "_parse", lambda self, buf: parses.append("ours") or real_parse(self, buf))
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append("GGUFReader") or pytest.fail("GGUFReader"))
    engine = AsyncEngine.from_pretrained(real_gguf, max_model_len=512)
    assert parses == ["ours"] and engine.max_model_len == 512
