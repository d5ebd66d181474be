"""The memory system through the engine: prefix caching, n > 1 samples, resets, salts, leaks, planning."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncinfer import AsyncEngine, ConfigurationError, InvalidParameterError, SamplingParams
from tests.helpers import ENGINE_BASE, greedy, hf_greedy, loaded_bytes

SYSTEM = [(7 * i) % 300 + 5 for i in range(96)]  # 6 full blocks of 16


def user_turns(k: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Distinct first tokens: requests share the system prompt and nothing after it.
    return [[100 + i] + [rng.randrange(3, 320) for _ in range(rng.randrange(4, 20))] for i in range(k)]


async def run_batch(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [o.token_ids for o in outs]


async def test_shared_system_prompt_is_computed_once_with_the_same_tokens(tiny_models) -> None:
    path, hf = tiny_models["llama"]
    turns = user_turns(6)
    prompts = [SYSTEM + t for t in turns]
    cached = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    plain = AsyncEngine.from_pretrained(path, **ENGINE_BASE, enable_prefix_caching=False)
    with_cache = await run_batch(cached, prompts, greedy(8))
    without = await run_batch(plain, prompts, greedy(8))
    assert with_cache == without
    assert with_cache == [hf_greedy(hf, p, 8) for p in prompts]
    user_tokens = sum(len(t) for t in turns)
    assert cached.core.stats.prefill_tokens == len(SYSTEM) + user_tokens  # the system prompt once
    assert plain.core.stats.prefill_tokens == len(prompts) * len(SYSTEM) + user_tokens
    stats = cached.kv_stats()
    assert stats.prefix_hits == (len(prompts) - 1) * len(SYSTEM)
    assert stats.prefix_queries == sum(len(p) for p in prompts)
    assert stats.used_blocks == 0 and stats.cached_free_blocks > 0
    assert plain.kv_stats().cached_blocks == 0


async def test_n_greedy_samples_equal_each_other_and_a_single_sample(tiny_models) -> None:
    path, hf = tiny_models["qwen2"]
    prompt = SYSTEM[:37]  # 2 full blocks + a shared partial block that each sample must copy
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        single = await engine.generate(prompt, greedy(20))
        out = await engine.generate(prompt, greedy(20, n=4))
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert single.token_ids == hf_greedy(hf, prompt, 20)
    assert all(c.token_ids == single.token_ids for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == "length"
    assert len(single.outputs) == 1 and single.outputs[0].token_ids == single.token_ids
    stats = engine.kv_stats()
    assert stats.cow_copies >= 3  # the shared partial block was copied, not written over
    assert stats.used_blocks == 0
    # The prompt was computed once for the four samples (the single run's prompt is cached too).
    assert engine.step_stats().prefill_tokens == len(prompt) + (len(prompt) - 32)


async def test_seeded_samples_match_independent_seeded_runs(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    prompt = SYSTEM[:21]
    params = SamplingParams(max_tokens=12, temperature=2.0, seed=1234, ignore_eos=True)
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        group = await engine.generate(prompt, params.with_updates(n=3))
        alone = [await engine.generate(prompt, params.with_updates(seed=1234 + i)) for i in range(3)]
    assert [c.token_ids for c in group.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1  # really different samples


async def test_stream_deltas_of_n_samples_carry_their_index(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    prompt = SYSTEM[:19]
    params = SamplingParams(max_tokens=9, temperature=1.5, seed=5, ignore_eos=True, n=3)
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async with engine:
        full = await engine.generate(prompt, params)
        deltas = [d async for d in engine.stream(prompt, params, request_id="x")]
        # Sample ids are reserved while the request runs.
        task = asyncio.create_task(engine.generate(prompt, greedy(50, n=2), request_id="y"))
        await asyncio.sleep(0)
        with pytest.raises(InvalidParameterError, match="request_id"):
            await engine.generate(prompt, greedy(2), request_id="y#1")
        await task
    for c in full.outputs:
        mine = [d for d in deltas if d.index == c.index]
        assert [t for d in mine for t in d.token_ids] == c.token_ids
        # One delta a step, unless the engine ran ahead of the reader (then pieces are merged).
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
    assert {d.request_id for d in deltas} == {"x"}


async def test_salts_and_reset_prefix_cache(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    prompt = SYSTEM[:70]
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    async def prefill_of(**kw) -> int:
        before = engine.step_stats().prefill_tokens
        await engine.generate(prompt, greedy(2), **kw)
        return engine.step_stats().prefill_tokens - before

    async with engine:
        assert await prefill_of() == 70
        assert await prefill_of() == 70 - 64  # 4 cached blocks
        assert await prefill_of(cache_salt="tenant-a") == 70  # another tenant shares nothing
        assert await prefill_of(cache_salt="tenant-a") == 6
        engine.reset_prefix_cache()
        assert await prefill_of() == 70
        assert await prefill_of(cache_salt="tenant-a") == 70
        with pytest.raises(InvalidParameterError, match="cache_salt"):
            await engine.generate(prompt, greedy(2), cache_salt=3)  # type: ignore[arg-type]
    assert engine.kv_stats().used_blocks == 0


async def test_every_block_comes_back_after_cancellations_at_random_points(tiny_models) -> None:
    path, _ = tiny_models["qwen2"]
    # A small cache: preemption, eviction and copy-on-write all happen. 24 blocks hold
    # about three of these requests at their longest, so running ones outgrow it whatever
    # the timing of the cancellations.
    engine = AsyncEngine.from_pretrained(path, **{**ENGINE_BASE, "kv_cache_memory": 24 * 2 * 2 * 2 * 16 * 16 * 4},
                                         max_num_batched_tokens=64)
    rng = random.Random(3)
    turns = user_turns(16, seed=1)
    async with engine:
        tasks = []
        for i, t in enumerate(turns):
            prompt = SYSTEM[: rng.randrange(10, 90)] + t
            params = SamplingParams(max_tokens=rng.randrange(20, 100), temperature=rng.choice([0.0, 1.0]),
                                    ignore_eos=True, n=rng.choice([1, 1, 2, 3]))
            tasks.append(asyncio.create_task(engine.generate(prompt, params, cache_salt=rng.choice([None, "b"]))))
        for t in tasks:
            await asyncio.sleep(rng.random() * 0.03)
            if rng.random() < 0.4:
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert any(isinstance(r, asyncio.CancelledError) for r in results)
        assert any(not isinstance(r, BaseException) for r in results)
        for _ in range(200):
            if not engine.core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        stats = engine.kv_stats()
    assert stats.used_blocks == 0 and stats.free_blocks == stats.num_blocks
    assert engine.kv_manager.request_ids() == []
    assert stats.prefix_hits > 0 and stats.cow_copies > 0 and stats.evictions > 0 and stats.preemptions > 0


def test_aborting_n_samples_before_and_after_the_fork_ends_every_sample(tiny_models) -> None:
    """Drive the synchronous core: abort a request of 3 samples before its prompt ran, and after."""
    from asyncinfer.request import Request

    path, _ = tiny_models["llama"]
    core = AsyncEngine.from_pretrained(path, **ENGINE_BASE).core
    early = Request("early", SYSTEM[:40], greedy(30, n=3), arrival_time=0.0)
    core.add_request(early)
    outs = core.abort_request("early")
    assert [(o.request_id, o.index, o.finish_reason) for o in outs] == [("early", i, "abort") for i in range(3)]
    late = Request("late", SYSTEM[:40], greedy(30, n=3), arrival_time=0.0)
    core.add_request(late)
    first = core.step()  # prompt computed, samples forked, each gets its first token
    assert sorted(o.index for o in first) == [0, 1, 2]
    core.step()
    assert sorted(core.scheduler.requests) == ["late", "late#1", "late#2"]
    outs = core.abort_request("late")
    assert sorted(o.index for o in outs) == [0, 1, 2] and core.abort_request("late") == []
    assert not core.has_unfinished_requests()
    assert core.kv.stats().used_blocks == 0 and core.kv.stats().cow_copies == 2


def test_plan_memory_before_loading_matches_the_engine(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    planned = AsyncEngine.plan_memory(path, **ENGINE_BASE)
    engine = AsyncEngine.from_pretrained(path, **ENGINE_BASE)
    assert planned.weight_bytes == loaded_bytes(engine.core.runner.model)  # the packed projections included
    assert planned == engine.memory_plan
    with pytest.raises(ConfigurationError, match=r"needs 16 blocks"):
        AsyncEngine.from_pretrained(path, **{**ENGINE_BASE, "kv_cache_memory": 15 * 2 * 2 * 2 * 16 * 16 * 4})
    with pytest.raises(ConfigurationError, match=r"needs 16 blocks"):
        AsyncEngine.plan_memory(path, **{**ENGINE_BASE, "kv_cache_memory": 15 * 2 * 2 * 2 * 16 * 16 * 4})
