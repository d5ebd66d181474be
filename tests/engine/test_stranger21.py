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


def test_embedding_plan_counts_the_largest_batch_max_batch_tokens_lets_run(minilm_dir) -> None:
    from asyncinfer.models.encoder import read_encoder_config

    cfg = read_encoder_config(minilm_dir)
    # The defaults, 32 texts and 2048 slots: at most 8 texts of 256 tokens run together (it planned 32 x 256).
    plan = AsyncEngine.plan_memory(minilm_dir, dtype="float32", device="cpu")
    assert plan.largest_batch == (8, 256)
    assert plan.activation_bytes == cfg.activation_bytes(8, 256, 4) == 84 * 2**20
    assert (plan.max_batch_size, plan.max_seq_len) == (32, 256)
    assert plan.describe() == "weights 86.1 MiB, activations 84.0 MiB (batch 8 x 256 tokens)"
    # Slots for every text of the batch: the options' whole product, as before.
    wide = AsyncEngine.plan_memory(minilm_dir, dtype="float32", device="cpu", max_batch_tokens=8192)
    assert wide.largest_batch == (32, 256) and wide.activation_bytes == 336 * 2**20
    # One slot: a text still runs, alone.
    assert AsyncEngine.plan_memory(minilm_dir, dtype="float32", device="cpu", max_batch_tokens=1).largest_batch == (1, 256)


async def test_the_batcher_runs_no_batch_larger_than_the_plan(minilm_dir) -> None:
    engine = await AsyncEngine.load(minilm_dir, dtype="float32", device="cpu", max_wait_ms=0)
    (info,) = engine.model_info()
    async with engine:
        await engine.embed(["word " * 300] * 20)  # truncated to 256 tokens each
        stats = engine.embedding_stats()
    assert max(stats.batch_sizes) == info.memory_plan.largest_batch[0] == 8
    assert sum(size * count for size, count in stats.batch_sizes.items()) == 20
