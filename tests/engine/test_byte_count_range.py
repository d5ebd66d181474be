"""A byte-count option past a torch size's range (``kv_cache_memory``, ``activation_reserve``, ``available_bytes`` =
``10**400``) is refused with ``InvalidParameterError`` naming it: the plan divided it as a float and failed with a
bare ``OverflowError`` ("integer division result too large for a float")."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, EngineConfig
from asyncinfer.errors import InvalidParameterError

HUGE = 10**400
MAX_BYTES = 2**63 - 1  # a torch size's range (asyncinfer.config.MAX_BYTES)


@pytest.mark.parametrize("option", ["kv_cache_memory", "activation_reserve"])
def test_an_engine_option_past_the_range_is_refused_naming_it(option: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        EngineConfig(**{option: HUGE})
    assert caught.value.parameter == option
    assert caught.value.allowed.endswith(f", {MAX_BYTES}]")
    EngineConfig(**{option: MAX_BYTES})  # the range's top is taken


@pytest.mark.parametrize("option", ["kv_cache_memory", "activation_reserve", "available_bytes"])
def test_the_plan_refuses_it(real_gguf, option: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        AsyncEngine.plan_memory(real_gguf, device="cpu", **{option: HUGE})
    assert caught.value.parameter == option


def test_available_bytes_at_the_top_of_the_range_plans(real_gguf) -> None:
    plan = AsyncEngine.plan_memory(real_gguf, device="cpu", max_model_len=256, available_bytes=MAX_BYTES)
    assert plan.num_blocks > 0
