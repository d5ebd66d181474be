"""asyncinfer.schedulers.testing and asyncinfer.conformance: the shipped conformance suite passes good
schedulers and names the broken rule of bad ones, from sync and async tests alike."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError, conformance
from asyncinfer.conformance import check_matches_fifo, check_scheduler, engine_tokens, tiny_model
from asyncinfer.request import Request
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput, testing
from asyncinfer.schedulers.testing import (
    LIMITS,
    ContractViolation,
    check_flags,
    check_no_starvation,
    check_rules,
    drive_random_load,
)
from tests.helpers import CountsRequestsNotSeats, QueuesForkedSamples


class OverBudget(FIFOScheduler):
    """Schedules one token more than the step budget allows."""

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        if out.num_scheduled_tokens:
            rid = next(iter(out.num_scheduled_tokens))
            out.num_scheduled_tokens[rid] += self.config.max_num_batched_tokens
        return out


class Idle(FIFOScheduler):
    """Never schedules anything."""

    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput()


class Undeclared(FIFOScheduler):
    uses_priority = "sometimes"


def test_a_conforming_plugin_passes_everything(tiny_models) -> None:
    report = check_scheduler(FIFOScheduler, seeds=range(2), model=tiny_models["llama"][0])
    # Every seed and limit, without and with parallel samples and prefix hits.
    assert report.scheduler == "FIFOScheduler" and report.load_runs == 2 * len(LIMITS) * 2
    assert report.preempted > 0 and report.aborted > 0 and report.engine_preemptions > 0


@pytest.mark.parametrize("cls, message", [
    (OverBudget, r"invariant 1 \(budget\): \d+ tokens > max_num_batched_tokens=64"),
    (Idle, r"invariant 3 \(progress\): scheduled nothing with 0 running and 1 waiting requests"),
])
def test_a_broken_rule_is_named_with_where_and_when(cls, message) -> None:
    with pytest.raises(ContractViolation, match=message) as err:
        check_scheduler(cls, engine=False)
    assert LIMITS[0] == (256, 4, 8, 64)
    assert (f"{cls.__name__} (seed 0, limits num_blocks=256, block_size=4, max_num_seqs=8, "
            "max_num_batched_tokens=64) step") in str(err.value)
    assert isinstance(err.value, AssertionError)  # pytest reports it as a failed assertion


@pytest.mark.parametrize("cls, message", [
    (QueuesForkedSamples, r"invariant 6 \(no queued request holds blocks\): queued requests hold blocks"),
    (CountsRequestsNotSeats, r"invariant 1 \(budget\): \d+ running, past max_num_seqs"),
])
def test_sample_bugs_fail_only_with_samples(cls, message) -> None:
    for seed in range(2):  # without samples, nothing forks: these bugs cannot show
        for limits in LIMITS:
            drive_random_load(cls, seed, limits)
    with pytest.raises(ContractViolation, match=message):
        check_scheduler(cls, engine=False)


class Lifo(FIFOScheduler):
    """Newest first, yet declares itself starvation-free (the base class's default)."""

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self.waiting.rotate(1)


class ReturnsNothing(FIFOScheduler):
    def schedule(self) -> SchedulerOutput:
        super().schedule()
        return None  # type: ignore[return-value]


class SkipsInit(FIFOScheduler):
    def __init__(self, config, kv) -> None:  # never calls super().__init__
        self.config = config


def test_starvation_is_caught_unless_declared() -> None:
    with pytest.raises(ContractViolation, match=r"Lifo: invariant 4 \(no starvation\): it declares starvation_free "
                                                r"but the first request \(priority 3"):
        check_scheduler(Lifo, engine=False)
    Lifo.starvation_free = False
    try:
        assert check_no_starvation(Lifo) is None  # declared: nothing to check
    finally:
        del Lifo.starvation_free
    assert check_no_starvation("aging-priority", {"aging_interval": None}) is None  # strict priority may starve
    assert check_no_starvation("fifo") == 4  # the first request runs at once
    assert 4 < check_no_starvation("aging-priority") < 2000  # served once aged


def test_malformed_schedulers_are_named_not_crashed_on() -> None:
    with pytest.raises(ContractViolation, match="schedule\\(\\) returned NoneType, not a SchedulerOutput"):
        check_scheduler(ReturnsNothing, engine=False)
    # Refused when built, as the engine's load refuses it (tests/schedulers/test_stranger26.py).
    with pytest.raises(InvalidParameterError, match=r"constructor calls super\(\).__init__\(config, kv\) \(SkipsInit's "
                                                    r"returned without it: no kv, waiting, running, requests\)"):
        check_scheduler(SkipsInit, engine=False)


def test_flags_must_be_declared() -> None:
    assert check_flags("aging-priority").uses_priority is True
    with pytest.raises(ContractViolation, match="Undeclared.uses_priority must be declared True or False"):
        check_flags(Undeclared)


def test_token_differences_are_reported(tiny_models) -> None:
    model = tiny_models["llama"][0]
    fifo, preemptions = engine_tokens(model, "fifo")
    assert preemptions > 0 and len(fifo) == 8
    assert check_matches_fifo("pd-split", {"prefill_budget": 5}, model=model, fifo=fifo) > 0
    wrong = [list(t) for t in fifo]
    wrong[3][-1] += 1
    with pytest.raises(ContractViolation, match="request 3's greedy tokens differ from FIFO's"):
        check_matches_fifo("fifo", model=model, fifo=wrong)


async def test_usable_from_an_async_test(tiny_models) -> None:
    assert drive_random_load("length-bucket", 1, LIMITS[1]).preempted >= 0
    assert check_matches_fifo("aging-priority", model=tiny_models["llama"][0]) >= 0  # its own loop, in a thread


def test_the_tiny_model_is_written_once_and_deterministic(tmp_path) -> None:
    first = tiny_model(tmp_path / "a")
    assert tiny_model(first) == first  # already there: kept
    again = tiny_model(tmp_path / "b")
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert engine_tokens(first, "fifo")[0] == engine_tokens(again, "fifo")[0]  # (preemptions vary with timing)


def test_the_rules_run_without_the_engine_and_the_engine_check_lives_above_it() -> None:
    rules = check_rules(FIFOScheduler, seeds=range(1))
    assert (rules.scheduler, rules.load_runs, rules.engine_preemptions) == ("FIFOScheduler", 2 * len(LIMITS), None)
    assert check_scheduler(FIFOScheduler, seeds=range(1), engine=False) == rules
    for name in ("check_scheduler", "check_matches_fifo", "engine_tokens", "tiny_model"):
        with pytest.warns(DeprecationWarning, match=rf"moved to asyncinfer.conformance.*from asyncinfer.conformance import {name}"):
            assert getattr(testing, name) is getattr(conformance, name)  # the old import still works
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        testing.nothing  # noqa: B018
