"""stranger21: a request id reused while its cancelled request is still being aborted is refused with the reason."""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams


async def test_reusing_the_id_of_a_cancelled_request_says_it_is_still_being_aborted(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, device="cpu", dtype="float32", kv_cache_memory=1 << 20, max_model_len=256)
    gate = threading.Event()
    gate.set()
    step = engine.core.step

    def gated_step():  # the engine thread waits here, so it cannot confirm the abort until the gate opens
        gate.wait()
        return step()

    engine.core.step = gated_step
    async with engine:
        stream = engine.stream([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), request_id="job-1")
        await stream.__anext__()
        gate.clear()
        await stream.aclose()  # the consumer goes away: an abort is posted, its id stays reserved
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="job-1")
        assert err.value.parameter == "request_id"
        assert str(err.value) == (
            "request_id='job-1' is invalid: allowed an id not used by a request in flight (a request with this id was "
            "cancelled and is still being aborted: its id is free once the engine has stopped it, at its next step)")
        with pytest.raises(InvalidParameterError) as other:  # n > 1 checks every sample's id, the reason is the same
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, n=2), request_id="job-1")
        assert str(other.value).endswith("(a request with this id was cancelled and is still being aborted: its id "
                                         "is free once the engine has stopped it, at its next step)")
        gate.set()
        for _ in range(200):
            try:
                out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="job-1")
                break
            except InvalidParameterError:
                await asyncio.sleep(0.01)
        assert len(out.token_ids) == 2


async def test_an_id_in_flight_keeps_the_plain_refusal(tiny_models) -> None:
    path, _ = tiny_models["llama"]
    engine = await AsyncEngine.load(path, device="cpu", dtype="float32", kv_cache_memory=1 << 20, max_model_len=256)
    gate = threading.Event()
    step = engine.core.step
    engine.core.step = lambda: (gate.wait(), step())[1]
    async with engine:
        task = asyncio.ensure_future(engine.generate([5, 6], SamplingParams(max_tokens=3), request_id="job-2"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate([5, 6], SamplingParams(max_tokens=2), request_id="job-2")
        assert str(err.value) == "request_id='job-2' is invalid: allowed an id not used by a request in flight"
        gate.set()
        assert len((await task).token_ids) == 3
