"""Adversarial pass 12 (in-process side): faults a hostile or careless caller sharing one engine could cause, found
and fixed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

BASE = {
    "kv_cache_memory": 4 * 1024 * 1024,
    "max_model_len": 512,
    "dtype": "float32",
    "device": "cpu",
    "block_size": 4,
    "num_threads": 1,
}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"][0]


# ----------------------------------------------------------------- num_threads is bounded
def test_num_threads_past_max_threads_is_an_invalid_parameter_at_every_entry(llama, capsys) -> None:
    """``num_threads=20000`` was taken as it was and handed to ``torch.set_num_threads`` at the load, where OpenMP
    aborted the whole process (no exception to catch, every other caller's requests gone with it). It is bounded
    by ``MAX_THREADS`` (4096) now: an InvalidParameterError naming ``num_threads`` and the range, from the config,
    ``from_pretrained``, ``load``, an embedding model's options and the command line's ``--threads``; torch's
    thread count is left as it was."""
    from asyncinfer import cli
    from asyncinfer.config import MAX_THREADS, EngineConfig
    from asyncinfer.embedding import EmbeddingConfig

    assert MAX_THREADS == 4096
    before = torch.get_num_threads()
    for config in (EngineConfig, EmbeddingConfig):
        with pytest.raises(InvalidParameterError) as info:
            config(num_threads=20000)
        assert (info.value.parameter, info.value.value, info.value.allowed) == (
            "num_threads", 20000, "an integer in [1, 4096]")
        assert config(num_threads=MAX_THREADS).num_threads == MAX_THREADS  # the bound itself is taken
    with pytest.raises(InvalidParameterError) as info:
        AsyncEngine.from_pretrained(llama, **{**BASE, "num_threads": MAX_THREADS + 1})
    assert info.value.parameter == "num_threads"
    with pytest.raises(InvalidParameterError) as info:
        asyncio.run(AsyncEngine.load(llama, **{**BASE, "num_threads": 20000}))
    assert info.value.parameter == "num_threads"
    assert cli.main(["generate", str(llama), "--prompt", "x", "--threads", "20000"]) == 2
    assert "--threads 20000 is invalid: allowed an integer in [1, 4096]" in capsys.readouterr().err
    assert torch.get_num_threads() == before


# ----------------------------------------------------------------- remove_model retires draining versions too
@pytest.mark.parametrize("abort", [False, True], ids=["drain", "abort"])
async def test_remove_model_after_an_overlapping_swap_ends_the_old_versions_requests(llama, abort) -> None:
    """After an overlapping swap (the new version serving while the old one still drains requests),
    ``remove_model`` retired only the serving version and then stopped stepping the model: the requests on the
    draining old version never ended, their callers waiting forever. The removal retires every live version now,
    as it promises: their requests finish (``abort=False``) or end with ``finish_reason="abort"``
    (``abort=True``), and the model is gone."""
    long, short = SamplingParams(max_tokens=300, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)
    async with AsyncEngine.from_pretrained(llama, **BASE) as engine:
        await engine.add_model("second", llama, **BASE)
        old = asyncio.ensure_future(engine.generate(GOOD, long, model="second"))
        while engine.step_stats("second").steps < 2:
            await asyncio.sleep(0.01)
        await engine.swap_model(llama, name="second")  # overlap: the old version drains `old`
        new = asyncio.ensure_future(engine.generate(GOOD, short, model="second"))  # ends first
        await asyncio.sleep(0)
        assert [i.state for i in engine.model_info() if i.name == "second"] == ["draining", "current"]
        await asyncio.wait_for(engine.remove_model("second", abort=abort), 60)
        outs = await asyncio.wait_for(asyncio.gather(old, new), 5)
        if abort:
            assert [o.finish_reason for o in outs] == ["abort", "abort"]
            assert len(outs[0].token_ids) < 300 and len(outs[1].token_ids) < 20
        else:
            assert [o.finish_reason for o in outs] == ["length", "length"]
            assert [len(o.token_ids) for o in outs] == [300, 20]
            assert outs[0].token_ids[:20] == outs[1].token_ids  # the same weights, greedy
        assert [i.name for i in engine.model_info()] == ["default"]
        assert len(engine._link.thread._holders) == 1
        out = await asyncio.wait_for(engine.generate(GOOD, SamplingParams(max_tokens=3)), 30)
        assert len(out.token_ids) == 3
