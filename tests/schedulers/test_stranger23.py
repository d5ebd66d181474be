"""A newcomer's first hour (stranger 23): a plugin on ``OrderedScheduler`` (docs/schedulers.md, "Writing one") that
forgets ``key_of`` (or any class leaving ``schedule`` abstract) is refused as the ``scheduler``, naming the missing
methods, when it is registered or named, before anything is loaded: it was registered silently and refused only
after the weights were read, as ``scheduler_options={} is invalid: ... its constructor raised TypeError``.

And the docs' example takes no options, so ``scheduler_options`` it does not take are refused before the weights are
read, as for the built-ins: ``OrderedScheduler.__init__(*args, **kwargs)`` let ``check_scheduler_options`` accept
any, and the load failed only after reading the model."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.schedulers import OrderedScheduler, Scheduler, SchedulerOutput, register_scheduler
from asyncinfer.schedulers.registry import check_scheduler_options, resolve_scheduler


class NoKey(OrderedScheduler):  # the docs' shortest-first-ordered, without key_of
    uses_priority = False
    starvation_free = False

    def lane_of(self, request):
        return 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self.admit_waiting(self.waiting_in(0), budget, out)
        return out


class NoSchedule(Scheduler):
    uses_priority = False
    starvation_free = False


@pytest.fixture(autouse=True)
def _forget_registrations(forget_registrations):
    """Every test here registers schedulers: conftest's forget_registrations undoes them."""


@pytest.mark.parametrize(("cls", "missing"), [(NoKey, "key_of"), (NoSchedule, "schedule")])
def test_an_abstract_plugin_is_refused_as_the_scheduler(cls, missing) -> None:
    with pytest.raises(InvalidParameterError) as info:
        register_scheduler("incomplete")(cls)
    assert info.value.parameter == "scheduler" and missing in str(info.value) and "'incomplete'" in str(info.value)
    from asyncinfer.schedulers import registry

    assert "incomplete" not in registry._REGISTERED
    for call in (resolve_scheduler, check_scheduler_options):  # check_scheduler_options runs before the weights
        with pytest.raises(InvalidParameterError) as info:
            call(cls)
        assert info.value.parameter == "scheduler" and missing in str(info.value) and "abstract" in str(info.value)


def test_an_option_the_documented_example_does_not_take_is_refused_before_loading() -> None:
    class ShortestFirstOrdered(NoKey):
        def key_of(self, request):
            return request.num_prompt_tokens + request.params.max_tokens

    assert check_scheduler_options(ShortestFirstOrdered, {}) is ShortestFirstOrdered
    with pytest.raises(InvalidParameterError) as info:
        check_scheduler_options(ShortestFirstOrdered, {"max_wait": 5})
    assert info.value.parameter == "scheduler_options" and "ShortestFirstOrdered accepts: none" in str(info.value)


def test_the_documented_example_still_registers() -> None:
    @register_scheduler("shortest-first-ordered")
    class ShortestFirstOrdered(NoKey):
        def key_of(self, request):
            return request.num_prompt_tokens + request.params.max_tokens

    assert resolve_scheduler("shortest-first-ordered") is ShortestFirstOrdered
