"""``asyncinfer lab`` with hostile plugins: a scheduler whose ``has_unfinished_requests()`` raises, or answers False
while requests it was given have not finished, is reported as its broken contract, naming it (it was an internal
error, ``IndexError: list index out of range`` past the trace's last arrival, or ``scheduler 222 broke the scheduler
contract: blocks not returned at the end``: the count read as the scheduler's name); so are a replay that never ends,
blocks a plugin never gave back, a plan whose ``num_scheduled_tokens`` is no dict, a ``num_running`` that raises and
a ``clock`` the lab cannot set (each was an internal error, status 1)."""

from __future__ import annotations

import pytest

from asyncinfer.cli import main
from asyncinfer.lab import ContractViolation, TraceRequest, simulate
from asyncinfer.schedulers import FIFOScheduler, SchedulerOutput

HERE = __name__


class NeverBusy(FIFOScheduler):
    api_version = 1

    def has_unfinished_requests(self) -> bool:
        return False


class BusyRaises(FIFOScheduler):
    api_version = 1

    def has_unfinished_requests(self) -> bool:
        raise RuntimeError("busy?")


class ForgetsRunning(FIFOScheduler):
    """Counts its waiting queue only: done once every request runs, with their tokens still to come."""

    api_version = 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)


class KeepsABlock(FIFOScheduler):
    """Takes a block for an id of its own at its first step and never gives it back."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        if not self.kv.block_table("mine"):
            self.kv.allocate_slots("mine", 1)
        return super().schedule()


class PlansAList(FIFOScheduler):
    """Hands back its plan's entries as a list of pairs (the engine refuses such a plan naming the plugin)."""

    api_version = 1

    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        out.num_scheduled_tokens = list(out.num_scheduled_tokens.items())  # type: ignore[assignment]
        return out


class CountRaises(FIFOScheduler):
    api_version = 1

    @property
    def num_running(self) -> int:
        raise RuntimeError("count?")


class ClockProp(FIFOScheduler):
    """Its clock a read-only property (wall time whatever the lab asks): the lab's simulated time cannot be set."""

    api_version = 1

    @property
    def clock(self):  # type: ignore[override]
        return lambda: 0.0


CONTRACT = "asyncinfer: error: scheduler {} broke the scheduler contract (docs/schedulers.md): {}"


@pytest.mark.parametrize(("cls", "said"), [
    (NeverBusy, ("at step 0 (0.000s): invariant 5 (nothing lost): has_unfinished_requests() answered False with 1 "
                "unfinished: 'r0'")),
    (BusyRaises, "at step 0 (0.000s): has_unfinished_requests() raised RuntimeError: busy?"),
    (ForgetsRunning, ("at step 1 (0.322s): invariant 5 (nothing lost): has_unfinished_requests() answered False with 1 "
                     "unfinished: 'r0'")),
    (PlansAList, ("at step 0 (0.000s): schedule() returned a SchedulerOutput whose num_scheduled_tokens is list, not a "
                 "dict of request ids to token counts")),
    (CountRaises, "at step 0 (0.000s): reading its plan and queues raised RuntimeError: count?"),
    # was "asyncinfer: internal error: AttributeError: property 'clock' of 'ClockProp' object has no setter"
    (ClockProp, ("its clock cannot be set (AttributeError: property 'clock' of 'ClockProp' object has no setter); the "
                 "lab replaces Scheduler.clock with simulated time, so a plugin reads the clock through it and leaves "
                 "it assignable (docs/schedulers.md)"))])
def test_a_hostile_plugin_broke_the_contract(cls: type, said: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lab", "--synthetic", "20", "--seed", "0", "--schedulers", f"{HERE}:{cls.__name__}",
                 "--plot", ""]) == 2
    assert capsys.readouterr().err.strip() == CONTRACT.format(cls.__name__, said)


def test_a_replay_that_never_ends_or_keeps_blocks_names_the_scheduler() -> None:
    trace = [TraceRequest(f"r{i}", 0.1 * i, 8, 4) for i in range(3)]
    with pytest.raises(ContractViolation) as err:
        simulate(trace, "fifo", max_steps=2)
    assert str(err.value) == "FIFOScheduler: invariant 3 (progress): no end after 2 steps"  # was "no end after ..."
    with pytest.raises(ContractViolation) as err:
        simulate(trace, KeepsABlock)
    assert str(err.value) == "KeepsABlock: invariant 5 (nothing lost): 1 block not returned at the end"
