"""A tenth stranger's first hour, in the engine: what misled, each held to its fix."""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import AsyncEngine, EngineOverloadedError, InvalidParameterError, SamplingParams

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}


async def test_a_limit_of_one_is_counted_in_the_singular(tiny_models) -> None:
    """``asyncinfer serve --max-num-seqs 1 --max-waiting-requests 0`` answered "has 1 requests in flight" and
    "at most 1 prompts in one call"."""
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=0) as engine:
        with pytest.raises(InvalidParameterError) as err:
            engine.check_admission(2)
        assert err.value.allowed == ("at most 1 prompt in one call: at most max_num_seqs=1 + max_waiting_requests=0 "
                                     "requests may be in flight")
        busy = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError) as full:
            await engine.generate([5, 6, 8], SamplingParams(max_tokens=2))
        assert str(full.value) == ("model 'default' has 1 request in flight (max_num_seqs=1 + max_waiting_requests=0); "
                                   "retry later.")
        await busy
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=2,
                                           max_waiting_requests=1) as engine:
        with pytest.raises(InvalidParameterError) as err:
            engine.check_admission(4)
        assert err.value.allowed.startswith("at most 3 prompts in one call")
