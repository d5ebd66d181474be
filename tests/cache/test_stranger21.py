"""stranger21: the default CPU KV budget holds its full-length requests whole, block rounding included."""

from __future__ import annotations

import asyncio

from asyncinfer.memory import DEFAULT_KV_FULL_REQUESTS, GiB, plan_memory

from .test_memory import SMOLLM2


def test_default_budget_rounds_each_request_up_to_whole_blocks() -> None:
    # 100 tokens take 7 blocks of 16 (112 slots): 4 such requests need 28 blocks, not ceil(400 / 16) = 25,
    # with which the fourth request was preempted once the others had grown.
    plan = plan_memory(SMOLLM2, available_bytes=8 * GiB, device="cpu", dtype="float32", max_model_len=100)
    assert plan.num_blocks == DEFAULT_KV_FULL_REQUESTS * 7 == 28
    assert plan.kv_token_capacity == 448
    wide = plan_memory(SMOLLM2, available_bytes=8 * GiB, device="cpu", dtype="float32", max_model_len=100,
                       block_size=32)
    assert wide.num_blocks == DEFAULT_KV_FULL_REQUESTS * 4 == 16
    two = plan_memory(SMOLLM2, available_bytes=8 * GiB, device="cpu", dtype="float32", max_model_len=33,
                      max_num_seqs=2)
    assert two.num_blocks == 2 * 3
    # A multiple of the block size is unchanged: 4 x 8192 tokens in 2048 blocks.
    assert plan_memory(SMOLLM2, available_bytes=8 * GiB, device="cpu", dtype="float32").num_blocks == 2048


async def test_four_full_length_requests_run_together_without_a_preemption(tiny_models) -> None:
    from asyncinfer import AsyncEngine, SamplingParams

    path, _ = tiny_models["llama"]
    # 40 tokens take 3 blocks of 16: 12 blocks for the 4 requests the default makes room for (it was 10).
    engine = AsyncEngine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=40, max_num_seqs=4,
                                         enable_prefix_caching=False)
    assert engine.memory_plan.num_blocks == 12
    async with engine:
        params = SamplingParams(max_tokens=29, ignore_eos=True)
        outs = await asyncio.gather(*[engine.generate([10 + i] * 11, params) for i in range(4)])
        assert [len(o.token_ids) for o in outs] == [29] * 4
        assert [o.metrics.num_preemptions for o in outs] == [0] * 4
        assert engine.kv_stats().preemptions == 0


def test_explicit_kv_cache_memory_is_held_to_the_memory_free_after_the_weights(real_gguf) -> None:
    # docs/memory.md: the activation reserve is not taken out of an explicit budget; past the free memory it is refused.
    import pytest

    from asyncinfer import ConfigurationError
    from asyncinfer.memory import MiB

    plan = plan_memory(real_gguf, available_bytes=1 * GiB, device="cpu", kv_cache_memory=931 * MiB)
    assert plan.num_blocks == 931 * MiB // 737_280 == 1324
    with pytest.raises(ConfigurationError) as err:
        plan_memory(real_gguf, available_bytes=1 * GiB, device="cpu", kv_cache_memory=932 * MiB)
    assert str(err.value) == ("kv_cache_memory=977272832 bytes (932.0 MiB) exceeds the 931.9 MiB free after loading "
                              "92.1 MiB of weights; lower kv_cache_memory")
