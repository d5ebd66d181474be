"""A built-in scheduler's number option given as an int past a float's range (``10**400``, what JSON reads from
``--scheduler-option aging_interval=1000...0``) is refused with ``InvalidParameterError`` naming the option: its
``float()`` raised ``OverflowError``, and the load failed as the model file's fault ("loading 'model.gguf' failed: int
too large to convert to float")."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine
from asyncinfer.cache.kv_manager import KVCacheManager
from asyncinfer.errors import InvalidParameterError
from asyncinfer.schedulers import SchedulerConfig
from asyncinfer.schedulers.registry import create_scheduler

HUGE = 10**400

CASES = [("aging-priority", "aging_interval"), ("aging-priority", "preempt_margin"), ("length-bucket", "max_wait")]


@pytest.mark.parametrize(("scheduler", "option"), CASES)
def test_an_int_past_a_floats_range_is_refused_naming_the_option(scheduler: str, option: str) -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    with pytest.raises(InvalidParameterError) as caught:
        create_scheduler(scheduler, config, KVCacheManager(16, 4), {option: HUGE})
    assert caught.value.parameter == option
    assert "within a float's range (about 1.8e308)" in caught.value.allowed


@pytest.mark.parametrize(("scheduler", "option"), CASES)
def test_the_plan_refuses_it_before_any_weight(real_gguf, scheduler: str, option: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        AsyncEngine.plan_memory(real_gguf, device="cpu", max_model_len=256, scheduler=scheduler,
                                scheduler_options={option: HUGE})
    assert caught.value.parameter == option


@pytest.mark.parametrize(("scheduler", "option", "value"), [
    ("aging-priority", "aging_interval", 10**300), ("aging-priority", "preempt_margin", 10**300),
    ("length-bucket", "max_wait", 10**300),
])
def test_a_large_int_within_range_still_runs(scheduler: str, option: str, value: int) -> None:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    create_scheduler(scheduler, config, KVCacheManager(16, 4), {option: value})
