"""Request identity, argument checks and event-loop safety at the engine's public API.

Each test reproduces a fault seen on an earlier version of the engine: an id
reused right after its task was cancelled mixed two requests; a malformed id
given to abort() killed the engine; a call from another event loop hung; a
huge text prompt stalled the caller's loop while it was tokenized.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asyncinfer import (
    AsyncEngine,
    EngineOverloadedError,
    InvalidParameterError,
    SamplingParams,
    WrongEventLoopError,
)

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 256, "dtype": "float32", "device": "cpu"}
PROMPT = [5, 17, 99, 3, 250, 42, 8]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def test_an_id_reused_after_a_cancel_never_mixes_two_requests(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, PROMPT, 12)
    engine = AsyncEngine.from_pretrained(path, **BASE)
    async with engine:
        for attempt in range(5):
            first = asyncio.create_task(engine.generate([7, 7, 7, 7], greedy(200), request_id="x"))
            await asyncio.sleep(0.02 * (attempt % 3))  # cancel before, during and after its prefill
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            # Until the engine thread confirmed the old "x" gone, the id is taken.
            reused = None
            for _ in range(500):
                try:
                    reused = await engine.generate(PROMPT, greedy(12), request_id="x")
                    break
                except InvalidParameterError as err:
                    assert err.parameter == "request_id"
                    await asyncio.sleep(0.001)
            assert reused is not None
            assert reused.token_ids == expected and reused.finish_reason == "length"
    assert engine.kv_stats().used_blocks == 0


async def test_abort_with_a_malformed_id_is_refused_and_the_engine_keeps_serving(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE)
    async with engine:
        running = asyncio.create_task(engine.generate(PROMPT, greedy(20)))
        await asyncio.sleep(0.01)
        for bad in (["a", "list"], {"a": 1}, None, 3, ""):
            with pytest.raises(InvalidParameterError) as err:
                engine.abort(bad)  # type: ignore[arg-type]
            assert err.value.parameter == "request_id"
        assert (await running).token_ids == hf_greedy(hf, PROMPT, 20)


@pytest.mark.parametrize("prompt", [b"\x05\x06", bytearray(b"\x05\x06"), range(5, 9)])
async def test_bytes_and_ranges_are_not_taken_as_token_ids(tiny_models, prompt) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE)
    async with engine:
        with pytest.raises(InvalidParameterError, match="prompt"):
            await engine.generate(prompt, greedy(2))  # type: ignore[arg-type]


async def test_a_call_from_another_event_loop_fails_at_once(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE)
    async with engine:
        outcome: list[BaseException | None] = []

        def other_thread() -> None:
            try:
                asyncio.run(engine.generate(PROMPT, greedy(4)))
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                outcome.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert isinstance(outcome[0], WrongEventLoopError)
        # The supported way from another thread: submit to the engine's own loop.
        loop = engine.loop
        assert loop is asyncio.get_running_loop()
        results: list = []
        thread = threading.Thread(target=lambda: results.append(
            asyncio.run_coroutine_threadsafe(engine.generate(PROMPT, greedy(4)), loop).result(30)))
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert results[0].token_ids == hf_greedy(hf, PROMPT, 4)


def test_a_second_asyncio_run_gets_a_clear_error_not_a_hang(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE)
    asyncio.run(engine.start())
    try:
        t0 = time.monotonic()
        with pytest.raises(WrongEventLoopError):
            asyncio.run(engine.generate(PROMPT, greedy(4)))
        assert time.monotonic() - t0 < 5
    finally:
        asyncio.run(engine.aclose())


async def test_stream_raises_at_the_call_before_any_delta(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE)
    async with engine:
        with pytest.raises(InvalidParameterError, match="prompt"):
            engine.stream([5, 99999], greedy(2))  # never iterated: the call itself raises
        with pytest.raises(InvalidParameterError, match="model"):
            engine.stream(PROMPT, greedy(2), model="no-such-model")
        with pytest.raises(InvalidParameterError, match="max_model_len"):
            engine.stream([5] * 256, greedy(2))
        with pytest.raises(InvalidParameterError, match="params"):
            engine.stream(PROMPT, {"max_tokens": 2})  # type: ignore[arg-type]
        with pytest.raises(InvalidParameterError, match="request_id"):
            engine.stream(PROMPT, greedy(2), request_id="")
        tokens = [t async for d in engine.stream(PROMPT, greedy(6)) for t in d.token_ids]
        assert tokens == hf_greedy(hf, PROMPT, 6)
        assert engine.num_unfinished_requests == 0


async def test_an_out_of_range_priority_is_refused_and_the_extremes_are_served(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, scheduler="aging-priority")
    async with engine:
        for bad in (10**400, 2**31, -(2**31) - 1, 1.5):
            with pytest.raises(InvalidParameterError) as err:
                await engine.generate(PROMPT, greedy(2), priority=bad)  # type: ignore[arg-type]
            assert err.value.parameter == "priority"
        outs = await asyncio.gather(*(engine.generate(PROMPT, greedy(5), priority=p)
                                      for p in (2**31 - 1, -(2**31), 0)))
        assert all(o.token_ids == hf_greedy(hf, PROMPT, 5) for o in outs)


async def test_admission_control_fails_fast_past_max_waiting_requests(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE, max_num_seqs=2, max_waiting_requests=1)
    async with engine:
        held = [asyncio.create_task(engine.generate(PROMPT, greedy(40))) for _ in range(3)]
        await asyncio.sleep(0)  # the three are in flight: two run, one waits
        with pytest.raises(EngineOverloadedError) as err:
            await engine.generate(PROMPT, greedy(2))
        assert err.value.retry_after > 0 and "max_waiting_requests=1" in str(err.value)
        with pytest.raises(EngineOverloadedError):
            engine.stream(PROMPT, greedy(2))  # at the call, before any delta
        outs = await asyncio.gather(*held)
        assert all(o.token_ids == hf_greedy(hf, PROMPT, 40) for o in outs)
        assert (await engine.generate(PROMPT, greedy(3))).token_ids == hf_greedy(hf, PROMPT, 3)


async def test_a_consumer_that_stops_reading_holds_one_pending_piece(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    engine = AsyncEngine.from_pretrained(path, **BASE)
    async with engine:
        deltas = engine.stream(PROMPT, greedy(30))
        first = await deltas.__anext__()
        for _ in range(500):  # the consumer sleeps while the request runs to its end and its last output reaches
            # the loop (the metrics count it there; the step stats count its tokens on the engine thread, before its
            # outputs are posted: read then, the last came as a piece of its own under a loaded machine's timing)
            if engine.metrics.snapshot().models["default"].requests.get("length", 0) >= 1:
                break
            await asyncio.sleep(0.01)
        rest = [d async for d in deltas]
        assert len(rest) == 1 and rest[0].finish_reason == "length"  # 29 tokens waited as one piece
        assert first.token_ids + rest[0].token_ids == hf_greedy(hf, PROMPT, 30)


async def test_a_request_id_is_bounded_in_length(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE)
    async with engine:
        with pytest.raises(InvalidParameterError) as err:
            await engine.generate(PROMPT, greedy(2), request_id="x" * 513)
        assert err.value.parameter == "request_id" and err.value.value == "<513 chars>"
        assert (await engine.generate(PROMPT, greedy(2), request_id="x" * 512)).finish_reason == "length"


async def test_an_id_is_held_while_its_call_is_bound_not_taken_by_a_later_call(tiny_models, hf_greedy) -> None:
    """A call waits before the engine thread knows its id (a drain-mode swap holds admission here; a grammar's
    compile or a turn the same way). A later call with the same id passed the check at its call, was bound first
    when it waited less, and the earlier call was refused for its own id once bound. The later call is refused at
    its call now (a stream made before the earlier one was read, at its first read), and the earlier one runs."""
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, PROMPT, 20)
    taken = "request_id='x' is invalid: allowed an id not used by a request in flight"
    async with await AsyncEngine.load(path, **BASE) as engine:
        old = asyncio.ensure_future(engine.generate(PROMPT, greedy(240)))
        while engine.step_stats().steps == 0:
            await asyncio.sleep(0.005)
        swap = asyncio.ensure_future(engine.swap_model(path, mode="drain"))  # waits for `old`
        while engine.model_info()[0].state != "draining":
            await asyncio.sleep(0.005)
        early = engine.stream(PROMPT, greedy(3), request_id="x")  # checked now, bound when first read
        first = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True, n=2),
                                                      request_id="x"))
        await asyncio.sleep(0.05)
        assert not first.done() and engine.num_unfinished_requests == 1  # waiting for admission, not yet posted
        with pytest.raises(InvalidParameterError) as err:
            engine.stream(PROMPT, greedy(3), request_id="x")
        assert str(err.value) == taken
        with pytest.raises(InvalidParameterError) as err:  # the id of its second sample
            engine.stream(PROMPT, greedy(3), request_id="x#1")
        assert str(err.value) == "request_id='x#1' is invalid: allowed an id not used by a request in flight"
        with pytest.raises(InvalidParameterError) as err:
            await early.__anext__()
        assert str(err.value) == taken
        await swap
        out = await asyncio.wait_for(first, 30)
        assert [o.token_ids for o in out.outputs] == [expected, expected]
        await old
        assert len((await engine.generate(PROMPT, greedy(20), request_id="x")).token_ids) == 20  # free again
        assert engine.kv_stats().used_blocks == 0
