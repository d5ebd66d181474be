"""A fiftieth stranger's first hour, in the engine: what misled, each held to its fix."""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}


async def test_a_request_no_retry_can_run_is_refused_as_invalid_while_the_engine_is_full(tiny_models) -> None:
    """``asyncinfer serve --max-num-seqs 1 --max-waiting-requests 0``: a request of ``n=2`` (or a stop token id past
    the vocabulary) is a 400 naming ``n`` when the engine is idle, but was a 503 ``overloaded`` with ``Retry-After: 1``
    (and counted as overloaded) whenever a request was in flight: the load was checked first, so a client retried
    what could never run."""
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=0) as engine:
        busy = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate([5, 6, 8], SamplingParams(max_tokens=2, n=2, temperature=1.0))
        assert (err.value.parameter, err.value.allowed) == ("n", "at most max_num_seqs=1 (samples run together)")
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate([5, 6, 8], SamplingParams(max_tokens=2, stop_token_ids=[10**6]))
        assert err.value.parameter == "stop_token_ids"
        assert engine.num_unfinished_requests == 1  # it was full all along
        rejected = engine.metrics.snapshot().models["default"].rejected
        await busy
    assert rejected == {"invalid": 2, "overloaded": 0}
