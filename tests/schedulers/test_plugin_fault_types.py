"""The conformance suite names a plugin's fault by type: a ``BaseException`` subclass of its own (or
``asyncio.CancelledError``) from its constructor or a hook is a ``ContractViolation`` as an ``Exception`` is (it
went through bare), and a planned count that is no ``int`` (a ``bool``, a ``float``) is refused by its type, naming
the request and the value, by the one rule the engine holds plans to."""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.request import Request
from asyncinfer.sampling_params import SamplingParams
from asyncinfer.schedulers import FIFOScheduler, SchedulerConfig
from asyncinfer.schedulers.testing import ContractViolation, check_rules, check_schedule


class Stop(BaseException):
    pass


class _CtorRaises(FIFOScheduler):
    api_version = 1
    raised: type[BaseException] = Stop

    def __init__(self, config, kv, *, fail=False):  # type: ignore[no-untyped-def]
        super().__init__(config, kv)
        if fail:
            raise self.raised("built")


class _CtorCancels(_CtorRaises):
    raised = asyncio.CancelledError


class _CtorExits(_CtorRaises):
    raised = SystemExit


@pytest.mark.parametrize(("cls", "shown"), [(_CtorRaises, "Stop: built"), (_CtorCancels, "CancelledError: built")])
def test_a_constructor_raising_a_base_exception_is_a_contract_violation_naming_the_plugin(cls, shown) -> None:
    with pytest.raises(ContractViolation, match=rf"^{cls.__name__} cannot be constructed as the engine constructs "
                                                rf"it \(scheduler\(config, kv, \*\*options\)\): its constructor "
                                                rf"raised {shown} with options \{{'fail': True\}}") as err:
        check_rules(cls, {"fail": True}, seeds=[0])
    assert type(err.value.__cause__) is cls.raised


def test_a_constructor_raising_system_exit_still_exits() -> None:
    with pytest.raises(SystemExit):
        check_rules(_CtorExits, {"fail": True}, seeds=[0])


class _ScheduleRaises(FIFOScheduler):
    """Fails at its 50th plan: past the constructor and the flags, in the random load."""

    api_version = 1
    raised: type[BaseException] = Stop

    def __init__(self, config, kv):  # type: ignore[no-untyped-def]
        super().__init__(config, kv)
        self.plans = 0

    def schedule(self):  # type: ignore[no-untyped-def]
        self.plans += 1
        if self.plans == 50:
            raise self.raised("in schedule")
        return super().schedule()


class _ScheduleCancels(_ScheduleRaises):
    raised = asyncio.CancelledError


class _ScheduleKeyError(_ScheduleRaises):
    raised = KeyError


class _ScheduleInterrupted(_ScheduleRaises):
    raised = KeyboardInterrupt


@pytest.mark.parametrize(("cls", "shown"), [(_ScheduleRaises, "Stop: in schedule"),
                                            (_ScheduleCancels, "CancelledError: in schedule"),
                                            (_ScheduleKeyError, "KeyError: 'in schedule'")])
def test_a_hook_raising_is_a_contract_violation_naming_the_plugin(cls, shown) -> None:
    # named with the seed, limits and step that replay it (drive_random_load, the first of check_rules' parts)
    with pytest.raises(ContractViolation,
                       match=rf"^{cls.__name__} \(seed 0, limits [^)]*\) step \d+: schedule\(\) raised {shown}$") as err:
        check_rules(cls, seeds=[0])
    assert type(err.value.__cause__) is cls.raised


def test_a_hook_raising_keyboard_interrupt_still_interrupts() -> None:
    with pytest.raises(KeyboardInterrupt):
        check_rules(_ScheduleInterrupted, seeds=[0])


@pytest.mark.parametrize(("count", "said"), [(True, "True tokens for 'r' (a bool, not an int)"),
                                             (3.0, "3.0 tokens for 'r' (a float, not an int)"),
                                             ("3", "'3' tokens for 'r' (a str, not an int)")])
def test_a_planned_count_that_is_no_int_is_refused_by_its_type_naming_the_request_and_value(count, said) -> None:
    """``True`` passed as a count of 1, and a float count was refused as a count out of range (or its slots)."""
    kv = KVCacheManager(16, 4)
    sched = FIFOScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32), kv)
    sched.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=0.0))
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"r": 3}
    plan.num_scheduled_tokens["r"] = count
    with pytest.raises(ContractViolation) as err:
        check_schedule(sched, plan, "P")
    assert str(err.value) == f"P: invariant 2 (each scheduled request): {said}"



def test_the_engine_and_check_schedule_hold_counts_to_one_type_rule() -> None:
    """One rule, not two copies: the engine's plan check reads the conformance suite's."""
    from asyncinfer import core
    from asyncinfer.schedulers import base, testing

    assert core.count_type_fault is base.count_type_fault is testing.count_type_fault

    class Count(int):
        pass

    assert base.count_type_fault("r", 3) is None and base.count_type_fault("r", Count(3)) is None
    assert base.count_type_fault("r", True) == "True tokens for 'r' (a bool, not an int)"
