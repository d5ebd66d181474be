"""A stranger's first hour writing a scheduler plugin for a multi-user service (stranger35).

examples/custom_scheduler.py, the per-tenant fair share docs/schedulers.md calls complete, took its ``weights`` option
unchecked, where the contract says to validate options and raise ``InvalidParameterError`` naming them. With
``--scheduler-option 'weights={"acme": 0}'`` the engine loaded and served until tenant "acme" sent a request; then
every ``schedule()`` raised ``ZeroDivisionError``: each such step failed every request the scheduler held (other
tenants' too) and the third ended the engine (``EngineDeadError`` for everyone). A negative, NaN or infinite weight
loaded as well, and put its tenant first for good or left the order meaningless, though the class declares itself
starvation-free.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from asyncinfer.cache import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers import SchedulerConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_scheduler.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("custom_scheduler_stranger35", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("weights", [{"acme": 0}, {"acme": -1.0}, {"acme": float("nan")}, {"acme": float("inf")},
                                     {"acme": "2"}, {"acme": True}, {1: 2.0}, [1.0], "acme"])
def test_the_example_refuses_a_weight_it_cannot_use(example, weights) -> None:
    with pytest.raises(InvalidParameterError) as info:
        example.FairShareScheduler(SchedulerConfig(), KVCacheManager(8, 4), weights=weights)
    assert info.value.parameter == "weights"


@pytest.mark.parametrize("weights", [None, {}, {"acme": 2}, {"acme": 0.5, "": 3.0}])
def test_the_example_takes_positive_weights(example, weights) -> None:
    sched = example.FairShareScheduler(SchedulerConfig(), KVCacheManager(8, 4), weights=weights)
    assert sched.weights == dict(weights or {})


def test_a_zero_weight_no_longer_fails_every_tenant(example) -> None:
    """Driven without a model: the zero weight's ``schedule()`` raised ZeroDivisionError with "acme" queued."""
    from asyncinfer import SamplingParams
    from asyncinfer.request import Request
    from asyncinfer.step import apply_step

    try:
        sched = example.FairShareScheduler(SchedulerConfig(max_model_len=64), KVCacheManager(32, 4),
                                           weights={"acme": 0})
    except InvalidParameterError:
        return
    for rid in ("bob/0", "acme/0"):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0))
    apply_step(sched, sched.schedule(), 0)  # raised ZeroDivisionError: every held request failed
    pytest.fail("the zero weight was taken")
