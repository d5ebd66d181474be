"""pass42: admission control during a drain-mode swap, and float16's refusal message.

A drain-mode swap, between the old version's retirement and the new one's switch, leaves its model with no version:
admission control (``max_waiting_requests``) read its bound from the serving version and checked nothing then. Every
request that came during the new version's load passed its call, waited the whole load counted nowhere a check read,
and at the switch those past ``max_num_seqs + max_waiting_requests`` were refused as overloaded, after their wait
(the first to have come first, the later ones counted against them), where "overload fails fast" and a drain-mode
swap's waiters "wait, they do not fail" (docs/reliability.md, docs/model_swaps.md). The bound is now the one of the
version that last served, while none does: the call past it is refused at once, and every waiter is admitted.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncinfer import AsyncEngine, EngineOverloadedError, SamplingParams
from tests.helpers import ENGINE_BASE, hold_swap_loads

LIMITED = {**ENGINE_BASE, "max_num_seqs": 1, "max_waiting_requests": 1}  # two places


async def test_a_drain_swaps_load_keeps_the_bound(tiny_models, monkeypatch) -> None:
    release = hold_swap_loads(monkeypatch, 20)
    path = tiny_models["llama"][0]
    async with await AsyncEngine.load(path, **LIMITED) as engine:
        swap = asyncio.ensure_future(engine.swap_model(path, mode="drain"))
        try:
            while engine._models.generator(None).current is not None:  # retired: none serves until the switch
                await asyncio.sleep(0.01)
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            waiters = [asyncio.ensure_future(engine.generate([5, 6, 7], params)) for _ in range(2)]
            await asyncio.sleep(0.05)
            assert not any(w.done() for w in waiters)  # the two places, waiting for the new version
            start = time.monotonic()
            with pytest.raises(EngineOverloadedError):  # a third is refused at its call, not after the load
                await asyncio.wait_for(engine.generate([5, 6, 7], params), 5)
            with pytest.raises(EngineOverloadedError):
                engine.check_admission(1)
            assert time.monotonic() - start < 1.0
        finally:
            release.set()
        await swap
        outs = await asyncio.gather(*waiters)  # every waiter runs: none is refused after its wait
        assert [len(o.token_ids) for o in outs] == [2, 2]
        engine.check_admission(2)




@pytest.mark.parametrize(("value", "says"), [
    (float("nan"), "got a NaN"),
    (float("inf"), "got a largest |w| of inf"),
    (65520.0, "got a largest |w| of 65520, which rounds to an infinity"),
])
def test_float16s_refusal_says_what_the_weight_holds(value, says) -> None:
    """float16's refusal of a weight (e568c40) said of every refused weight that it "rounds to an infinity": a NaN
    too, which rounds to nothing."""
    import torch

    from asyncinfer.models.quant import Fp16Linear

    weight = torch.zeros(8, 8)
    weight[1, 2] = value
    with pytest.raises(ValueError) as caught:
        Fp16Linear(weight, None)
    assert str(caught.value).endswith(says), str(caught.value)
