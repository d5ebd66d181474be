import asyncio, time
import pytest
import asyncinfer.intake
from asyncinfer import AsyncEngine, SamplingParams, ModelChangedError
from asyncinfer.sampling_params import MAX_STOP_CHARS
from tests.helpers import ENGINE_BASE, tiny_hf_model, long_stops, fill_stop_turns, CharTokenizer


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = []
    for seed in (0, 1):
        p = tmp_path_factory.mktemp(f"m{seed}")
        tiny_hf_model("llama", seed, vocab_size=320).save_pretrained(p, safe_serialization=True)
        out.append(p)
    return out


@pytest.mark.parametrize("mode", ["drain", "abort"])
async def test_swap_while_waiting(two, monkeypatch, mode):
    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", MAX_STOP_CHARS)  # a list at the limit: 1 s
    async with await AsyncEngine.load(two[0], **ENGINE_BASE, num_threads=1) as engine:
        await engine.add_model("b", two[1], **ENGINE_BASE)
        free = {None: engine.core.kv.num_free_blocks}
        await fill_stop_turns(engine, long_stops)
        v0 = engine.model_info().version_id
        t0 = time.monotonic()
        tasks = {
            "pinned": asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=3, stop=long_stops(10)), version_id=v0)),
            "n2": asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=3, n=2, stop=long_stops(11)))),
            "b": asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=3, stop=long_stops(12)), model="b")),
            "abortme": asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=3, stop=long_stops(13)), request_id="abortme")),
        }
        await asyncio.sleep(0.3)
        info = await engine.swap_model(two[1], mode=mode)
        ts = time.monotonic() - t0
        engine.abort("abortme")
        res = {}
        for k, t in tasks.items():
            try:
                r = await asyncio.wait_for(t, 30)
                res[k] = ("ok", [o.finish_reason for o in r.outputs], round(time.monotonic() - t0, 2))
            except Exception as exc:
                res[k] = (type(exc).__name__, str(exc)[:80], round(time.monotonic() - t0, 2))
        print(mode, "swap took", round(ts, 2), res)
        await asyncio.sleep(0.2)
        print("free", free, engine.core.kv.num_free_blocks, engine.core.kv.num_blocks)
        assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
