"""``engine.num_unfinished_requests`` as docs/api.md states it: requests of every generator in flight, a request
of ``n`` samples once."""

from __future__ import annotations

from asyncinfer import AsyncEngine, SamplingParams
from tests.helpers import ENGINE_BASE


async def test_every_generator_counts_and_n_samples_count_once(tiny_models) -> None:
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    async with engine:
        await engine.add_model("qwen", tiny_models["qwen2"][0], **ENGINE_BASE)
        long = SamplingParams(max_tokens=200, ignore_eos=True, n=3, temperature=1.0, seed=1)
        other = engine.stream([4, 5, 6], SamplingParams(max_tokens=200, ignore_eos=True), model="qwen")
        await anext(other)
        assert engine.num_unfinished_requests == 1
        async for _ in engine.stream([1, 2, 3], long):
            assert engine.num_unfinished_requests == 2
            break
        await other.aclose()
    assert engine.num_unfinished_requests == 0
