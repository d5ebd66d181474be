"""An abort of a request waiting its turn leaves its trace (pass40). Since such an abort ends the wait at once
(pass39), the request ends as an abort without ever being posted: its caller gets every sample with
``finish_reason="abort"``, but ``asyncinfer_requests_total{finish_reason="abort"}`` did not count it and the
``asyncinfer.requests`` logger wrote no line for it, while the same abort a moment later (once bound) was counted
and logged, and docs/monitoring/README.md promises one line per finished generation request."""

from __future__ import annotations

import asyncio
import logging

import pytest

import asyncinfer.intake
from asyncinfer import AsyncEngine, SamplingParams
from asyncinfer.sampling_params import MAX_STOP_CHARS
from tests.helpers import ENGINE_BASE, CharTokenizer, fill_stop_turns, send_victim


def _stops(variant: int) -> list[str]:
    return [chr(0xE000 + variant) * MAX_STOP_CHARS]


def _requests(engine: AsyncEngine) -> dict[str, int]:
    return dict(engine.metrics.snapshot().models["default"].requests)


@pytest.mark.parametrize("how", ["generate", "stream"])
async def test_an_abort_while_waiting_its_turn_is_counted_and_logged(tiny_models, monkeypatch, caplog, how) -> None:
    monkeypatch.setattr(asyncinfer.intake, "STOP_BUILD_CHARS_PER_S", MAX_STOP_CHARS / 20)  # 20 s a turn
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **ENGINE_BASE)
    engine.core.tokenizer = CharTokenizer()  # stop strings need a tokenizer (a model without one refuses them)
    async with engine:
        await fill_stop_turns(engine, _stops)
        before = _requests(engine)
        caplog.set_level(logging.INFO, logger="asyncinfer.requests")
        params = SamplingParams(max_tokens=4, n=2, stop=_stops(5))
        waiter = send_victim(engine, params, how)
        await asyncio.sleep(0.1)
        engine.abort("victim")
        out = await asyncio.wait_for(waiter, 5)
        ends = [c.finish_reason for c in out.outputs] if how == "generate" else [d.finish_reason for d in out]
        assert ends == ["abort", "abort"]
        after = _requests(engine)
        assert after["abort"] == before["abort"] + 1, (before, after)
        assert {k: v for k, v in after.items() if k != "abort"} == {k: v for k, v in before.items() if k != "abort"}
        lines = [r.getMessage() for r in caplog.records if r.name == "asyncinfer.requests"]
        assert any("id=victim" in line and "finish_reason=abort" in line and "prompt_tokens=3" in line
                   for line in lines), lines
        # a cancelled waiter raises (no result): nothing is counted for it, as before
        waiter = asyncio.ensure_future(engine.generate([5, 6, 7], params, request_id="gone"))
        await asyncio.sleep(0.1)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert _requests(engine) == after
        again = await engine.generate([5, 6, 7], SamplingParams(max_tokens=1), request_id="victim")  # the id is free
        assert again.outputs[0].finish_reason == "length"
