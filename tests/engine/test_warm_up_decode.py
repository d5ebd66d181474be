"""The load's warm-up runs a decode step as well as a prefill (docs/schedulers.md, "When it goes wrong"): a scheduler
plugin whose plan breaks the contract, or whose hook raises, only for a request in decode passed a warm-up of one
prefill (``max_tokens=1``: the request ended at its first step), and the load succeeded with a scheduler that then
failed every request of more than one token."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, ModelLoadError
from asyncinfer.core import SchedulerPlanError
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput
from tests.helpers import ENGINE_BASE


class ZeroInDecode(FIFOScheduler):
    """Plans 0 tokens (against the contract) for every request in decode; prefills as FIFO does."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        for request_id in out.num_scheduled_tokens:
            request = next((r for r in self.running if r.request_id == request_id), None)
            if request is not None and request.is_decode:
                out.num_scheduled_tokens[request_id] = 0
        return out


class RaisesInDecode(FIFOScheduler):
    """``schedule()`` raises once a request is in decode."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        if any(r.is_decode for r in self.running):
            raise KeyError("decode")
        return super().schedule()


@pytest.mark.parametrize(("cls", "said"), [
    (ZeroInDecode, ("the scheduler ZeroInDecode failed the warm-up request: request 'warm-up' failed: its scheduler's "
                   "plan raised SchedulerPlanError: the scheduler (ZeroInDecode) planned 0 tokens for 'warm-up'")),
    (RaisesInDecode, "the scheduler RaisesInDecode raised KeyError: 'decode' during warm-up, in its own code")])
def test_a_fault_at_decode_only_fails_the_load(tiny_models, cls: type, said: str) -> None:
    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=cls)
    assert str(err.value).startswith(f"loading {str(path)!r} failed: {said}"), str(err.value)
    if cls is ZeroInDecode:
        assert isinstance(err.value.__cause__.__cause__.__cause__, SchedulerPlanError)
