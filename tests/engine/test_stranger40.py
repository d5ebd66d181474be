"""A fortieth stranger's scheduler plugins (docs/schedulers.md, "When it goes wrong"): a hook that raises, or a plan
that breaks the contract, during the load's warm-up fails the load naming the scheduler. Such a fault fails its
request alone, not the step, so the warm-up request failed quietly and the load succeeded with a scheduler that
then failed every request sent to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncinfer import AsyncEngine, ModelLoadError, RequestFailedError
from asyncinfer.core import SchedulerPlanError
from asyncinfer.request import Request
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput
from tests.helpers import ENGINE_BASE


class AddRaises(FIFOScheduler):
    api_version = 1

    def add_request(self, request: Request) -> None:
        raise RuntimeError("add always")


class FinishRaises(FIFOScheduler):
    api_version = 1

    def finish_requests(self, requests: list[Request]) -> None:
        if requests:  # a step that finished none is not faulted: the fault is the finished request's alone
            raise RuntimeError("finish always")


class PlansZero(FIFOScheduler):
    api_version = 1

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        for request_id in out.num_scheduled_tokens:
            out.num_scheduled_tokens[request_id] = 0
        return out


FINISH_RAISED = "the scheduler (FinishRaises) in finish_requests raised RuntimeError: finish always"


@pytest.mark.parametrize(("cls", "raised"), [(AddRaises, "adding it to the scheduler raised RuntimeError: add always"),
                                             (FinishRaises, FINISH_RAISED)])
def test_a_hook_that_raises_during_warm_up_fails_the_load(tiny_models, cls: type, raised: str) -> None:
    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=cls)
    assert str(err.value) == (
        f"loading {str(path)!r} failed: the scheduler {cls.__name__} failed the warm-up request, in its own code "
        f"({Path(__file__).resolve()}): request 'warm-up' failed: {raised} (the load is refused; "
        "docs/schedulers.md, \"When it goes wrong\")")
    assert isinstance(err.value.__cause__, RuntimeError)
    assert isinstance(err.value.__cause__.__cause__, RequestFailedError)
    assert isinstance(err.value.__cause__.__cause__.__cause__, RuntimeError)


def test_a_plan_that_breaks_the_contract_during_warm_up_fails_the_load(tiny_models) -> None:
    path = tiny_models["llama"][0]
    with pytest.raises(ModelLoadError) as err:
        AsyncEngine.from_pretrained(path, **ENGINE_BASE, scheduler=PlansZero)
    assert str(err.value).startswith(
        f"loading {str(path)!r} failed: the scheduler PlansZero failed the warm-up request: request 'warm-up' failed: "
        "its scheduler's plan raised SchedulerPlanError: the scheduler (PlansZero) planned 0 tokens for 'warm-up'")
    assert isinstance(err.value.__cause__.__cause__.__cause__, SchedulerPlanError)


class PlansAStranger(FIFOScheduler):
    """A plan that names, at every step, an id the scheduler never held."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        out.num_scheduled_tokens["nobody"] = 1
        return out


def test_a_stray_id_planned_at_every_step_is_logged_once(tiny_models, caplog: pytest.LogCaptureFixture) -> None:
    """It was one ERROR line per step (a server's log flooded for as long as the plugin ran); the entry still
    leaves every plan, and the requests run."""
    import asyncio
    import logging

    from asyncinfer import SamplingParams

    async def run() -> list[str]:
        engine = await AsyncEngine.load(tiny_models["llama"][0], **ENGINE_BASE, scheduler=PlansAStranger)
        async with engine:
            outs = await asyncio.gather(*(engine.generate([5 + i, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
                                          for i in range(3)))
        return [out.finish_reason for out in outs]

    with caplog.at_level(logging.ERROR, logger="asyncinfer"):
        assert asyncio.run(run()) == ["length"] * 3
    lines = [r.getMessage() for r in caplog.records if "a request it does not hold" in r.getMessage()]
    once = "the scheduler (PlansAStranger) planned 1 tokens for 'nobody', a request it does not hold: left out"
    assert lines == [f"{once} (logged once for this id)"]
