"""AsyncEngine end to end on tiny random models: exact tokens, batching, preemption, cancellation."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import torch

from asyncinfer import (
    AsyncEngine,
    EngineClosedError,
    EngineState,
    InvalidParameterError,
    SamplingParams,
)
from asyncinfer.request import Request
from tests.helpers import ENGINE_BASE, greedy, hf_greedy, hf_logits, random_prompts

# Small budgets (ENGINE_BASE) keep these engines light; each test builds its own engine.


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
async def test_greedy_tokens_equal_transformers_with_staggered_arrivals(kind, tiny_models) -> None:
    path, hf = tiny_models[kind]
    ps = random_prompts(6, seed=3)
    lengths = [5, 17, 9, 24, 12, 30]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE, max_num_batched_tokens=48)
    async with engine:

        async def one(i: int):
            await asyncio.sleep(0.01 * i)  # arrive while others are mid-prefill / decoding
            return await engine.generate(ps[i], greedy(lengths[i]))

        outs = await asyncio.gather(*(one(i) for i in range(len(ps))))
        assert max(engine.step_stats().batch_sizes) > 1  # they really shared steps
    for p, n, out in zip(ps, lengths, outs):
        assert out.token_ids == hf_greedy(hf, p, n)
        assert out.finish_reason == "length" and out.prompt_token_ids == p
    assert engine.kv_stats().used_blocks == 0


def test_core_mixes_prefill_and_decode_in_one_step(tiny_models) -> None:
    """Drive the synchronous core by hand: a request arrives while another decodes."""
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE, max_num_batched_tokens=16)
    core = engine.core
    ps = random_prompts(3, seed=5)
    reqs = [Request(f"r{i}", p, greedy(12), arrival_time=0.0) for i, p in enumerate(ps)]
    core.add_request(reqs[0])
    steps = 0
    mixed = False
    while core.has_unfinished_requests() or steps < 4:
        if steps in (2, 4):
            core.add_request(reqs[steps // 2])
        before = dict(core.stats.__dict__)
        core.step()
        steps += 1
        if core.stats.prefill_tokens > before["prefill_tokens"] and core.stats.decode_tokens > before["decode_tokens"]:
            mixed = True
    assert mixed, "no step ran prefill and decode tokens together"
    for p, r in zip(ps, reqs):
        assert r.output_token_ids == hf_greedy(hf, p, 12)
    assert core.kv.num_free_blocks == core.kv.num_blocks


async def test_preemption_recomputes_to_the_same_tokens(tiny_models) -> None:
    path, hf = tiny_models["llama"]
    # 16 blocks of 4 tokens: 8 requests growing to ~50 tokens cannot all stay resident.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4
    engine = AsyncEngine.from_pretrained(
        path, **{**ENGINE_BASE, "kv_cache_memory": 16 * block_bytes, "max_model_len": 64}, block_size=4
    )
    assert engine.memory_plan.num_blocks == 16
    ps = random_prompts(8, seed=7)
    ps = [p[:14] for p in ps]
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy(30)) for p in ps))
    assert engine.step_stats().preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == engine.step_stats().preemptions
    for p, out in zip(ps, outs):
        assert out.token_ids == hf_greedy(hf, p, 30)
    assert engine.kv_stats().used_blocks == 0


async def test_cancel_break_and_abort_free_every_block(tiny_models) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        # 1. Breaking out of a stream aborts its request.
        got = 0
        async for delta in engine.stream(random_prompts(1)[0], greedy(200)):
            got += len(delta.token_ids)
            if got >= 3:
                break
        # 2. Cancelling the task awaiting generate() aborts it.
        task = asyncio.create_task(engine.generate(random_prompts(1, 1)[0], greedy(200)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # 3. engine.abort(request_id) ends the request with finish_reason "abort".
        aborted = asyncio.create_task(engine.generate(random_prompts(1, 2)[0], greedy(200), request_id="victim"))
        await asyncio.sleep(0.05)
        engine.abort("victim")
        out = await aborted
        assert out.finish_reason == "abort" and len(out.token_ids) < 200
        # Cancellation at random points of many concurrent requests.
        rng = random.Random(0)
        tasks = [asyncio.create_task(engine.generate(p, greedy(60))) for p in random_prompts(12, 9)]
        for t in tasks:
            await asyncio.sleep(rng.random() * 0.02)
            if rng.random() < 0.5:
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert any(isinstance(r, asyncio.CancelledError) for r in results)
        # The engine still serves, and every block comes back at the step boundary.
        after = random_prompts(1, 3)[0]
        assert (await engine.generate(after, greedy(4))).token_ids == hf_greedy(hf, after, 4)
        for _ in range(100):
            if engine.kv_stats().used_blocks == 0 and not engine.core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert engine.kv_stats().used_blocks == 0
        assert engine.num_unfinished_requests == 0


async def test_a_stream_kept_in_a_variable_and_left_by_break_is_aborted_by_aclose(tiny_models) -> None:
    """``break`` closes an async generator only once nothing refers to it: the guide said "leaving the
    async for early does the same" (aborts), which a stream kept in a variable did not do until closed.
    ``aclose()`` and ``contextlib.aclosing`` abort it at once, as the guide and the docstring now say."""
    import contextlib
    import inspect

    path, _ = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        deltas = engine.stream(random_prompts(1)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in deltas:
            break
        await deltas.aclose()
        async with contextlib.aclosing(engine.stream(random_prompts(1, 1)[0],
                                                     SamplingParams(max_tokens=200, ignore_eos=True))) as more:
            async for _ in more:
                break
        for _ in range(100):
            if engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_unfinished_requests == 0 and engine.kv_stats().used_blocks == 0
        assert engine.metrics.snapshot().models["default"].requests["abort"] == 2
    doc = inspect.getdoc(AsyncEngine.stream)
    guide = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "asyncio.md").read_text(encoding="utf-8")
    for text in (doc, guide):
        assert "aclose()" in text and "contextlib.aclosing" in text, text


async def test_stream_deltas_add_up_to_generate(tiny_models) -> None:
    path, _ = tiny_models["qwen2"]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    p = random_prompts(1, 11)[0]
    async with engine:
        full = await engine.generate(p, greedy(20))
        deltas = [d async for d in engine.stream(p, greedy(20))]
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    # One delta per step, unless the consumer lagged (pieces not yet read are merged).
    assert 1 <= len(deltas) <= 20 and all(d.token_ids for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


async def test_seeded_sampling_is_independent_of_the_batch(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    p = random_prompts(1, 4)[0]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        alone = await engine.generate(p, params)
        others = SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
        crowd = await asyncio.gather(*(engine.generate(q, others) for q in random_prompts(5)),
                                     engine.generate(p, params))
        other_seed = await engine.generate(p, params.with_updates(seed=99))
    assert crowd[-1].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


async def test_stop_token_ids_and_logprobs(tiny_models) -> None:
    path, hf = tiny_models["llama"]
    p = random_prompts(1, 6)[0]
    ref = hf_greedy(hf, p, 10)
    stop_at = ref[4]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        out = await engine.generate(p, SamplingParams(max_tokens=10, stop_token_ids=[stop_at], logprobs=2))
    first = ref.index(stop_at)
    assert out.token_ids == ref[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(lp.token_id == t and len(lp.top) == 2 for lp, t in zip(out.logprobs, out.token_ids))
    assert all(lp.top[0][0] == t for lp, t in zip(out.logprobs, out.token_ids))  # greedy picks the top-1
    # The values are transformers' log-softmax at each position, the top two in order.
    ref_logprobs = torch.log_softmax(hf_logits(hf, p + out.token_ids), dim=-1)[len(p) - 1 : -1]
    for lp, row in zip(out.logprobs, ref_logprobs):
        values, ids = row.topk(2)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


async def test_bad_input_is_a_typed_error_and_the_engine_keeps_serving(tiny_models) -> None:
    path, hf = tiny_models["llama"]
    with pytest.raises(InvalidParameterError, match="no_such_option"):
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, no_such_option=1)
    with pytest.raises(InvalidParameterError, match="max_num_seqs"):
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, max_num_seqs=0)
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    with pytest.raises(EngineClosedError):
        await engine.generate([5, 6], greedy(2))
    async with engine:
        with pytest.raises(InvalidParameterError, match="prompt"):
            await engine.generate([5, 999_999], greedy(2))
        for bad in ([10**9], [5, 320]):  # the tiny model's vocabulary is 0..319 (SamplingParams refuses < 0)
            with pytest.raises(InvalidParameterError) as err:
                await engine.generate([5, 6], SamplingParams(max_tokens=2, stop_token_ids=bad))
            assert err.value.parameter == "stop_token_ids" and err.value.allowed == "token ids in [0, 319]"
            with pytest.raises(InvalidParameterError, match="stop_token_ids"):
                engine.stream([5, 6], SamplingParams(max_tokens=2, stop_token_ids=bad))  # at the call
        with pytest.raises(InvalidParameterError, match="prompt"):
            await engine.generate([], greedy(2))
        with pytest.raises(InvalidParameterError, match="max_model_len"):
            await engine.generate([5] * 300, greedy(2))
        with pytest.raises(InvalidParameterError, match="prompt"):
            await engine.generate("text needs a tokenizer", greedy(2))  # tiny model has none
        with pytest.raises(InvalidParameterError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        with pytest.raises(InvalidParameterError, match="params"):
            await engine.generate([5, 6], {"max_tokens": 3})  # type: ignore[arg-type]
        out = await engine.generate([5, 6, 7], greedy(3))
        assert out.token_ids == hf_greedy(hf, [5, 6, 7], 3)
        # Prompt + max_tokens over max_model_len is refused, naming max_tokens and the room left (as vLLM does).
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate([5] * 250, greedy(100))
        assert err.value.parameter == "max_tokens" and "256 - 250 = 6" in err.value.allowed
    assert engine.state is EngineState.CLOSED
    with pytest.raises(EngineClosedError):
        await engine.generate([5, 6], greedy(2))


async def test_event_loop_stays_responsive_under_full_load(tmp_path) -> None:
    """Model work runs off the event loop: a 5 ms ticker keeps ticking during heavy steps."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    engine = AsyncEngine.from_pretrained(tmp_path, kv_cache_memory=64 * 2**20, max_model_len=512,
                                         max_num_batched_tokens=2048, device="cpu")
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - t - 0.005)

    async with engine:
        tick = asyncio.create_task(ticker())
        t0 = time.perf_counter()
        ps = [[(7 * i + j) % 500 + 3 for j in range(200)] for i in range(16)]
        await asyncio.gather(*(engine.generate(p, greedy(24)) for p in ps))
        wall = time.perf_counter() - t0
        done.set()
        await tick
    steps = engine.step_stats().steps
    lags.sort()
    p99 = lags[int(0.99 * (len(lags) - 1))]
    # Mean step time is wall/steps; were the model on the loop, lag would reach a whole prefill step.
    assert wall / steps > 0.02, "steps too light to tell the difference"
    assert p99 < 0.05, f"event-loop lag p99 {p99 * 1000:.1f} ms (mean step {1000 * wall / steps:.1f} ms)"
