"""In-process misuse found by a fresh adversarial pass (issue 25, after the lying-inputs round).

``SamplingParams`` checks its values when it is built, but the engine took any instance as it came: a
subclass whose ``__post_init__`` skips the checks carried a NaN temperature or a stop list past
``MAX_STOP_STRINGS`` into the engine, and so did a plain instance whose ``stop`` (or ``stop_token_ids``)
list was grown in place after it was built. The engine now builds each request's parameters again from
what they hold at the call (``sampling_params.plain_params``): refused there, by name, like any bad value.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, plain_params

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}
GOOD = [(29 * j) % 300 + 7 for j in range(9)]


class Unchecked(SamplingParams):
    """Parameters that skip every check when built."""

    def __post_init__(self) -> None:
        pass


def _grown_stop() -> SamplingParams:
    params = SamplingParams(max_tokens=4, stop=["a"])
    assert isinstance(params.stop, list)
    params.stop.extend(["b"] * MAX_STOP_STRINGS)  # the list is the caller's: it grows after the checks
    return params


def _grown_stop_ids() -> SamplingParams:
    params = SamplingParams(max_tokens=4, stop_token_ids=[1])
    assert params.stop_token_ids is not None
    params.stop_token_ids.extend([1] * MAX_STOP_TOKEN_IDS)
    return params


LYING = {  # what the call must refuse, and the parameter it names
    "nan temperature": (lambda: Unchecked(max_tokens=4, temperature=math.nan), "temperature"),
    "top_p 0": (lambda: Unchecked(max_tokens=4, temperature=1.0, top_p=0.0), "top_p"),
    "stop list past the limit": (lambda: Unchecked(max_tokens=4, stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    "n past its range": (lambda: Unchecked(max_tokens=4, n=10_000), "n"),
    "stop list grown after it was built": (_grown_stop, "stop"),
    "stop ids grown after they were built": (_grown_stop_ids, "stop_token_ids"),
}


@pytest.mark.parametrize("case", LYING)
def test_plain_params_checks_what_the_parameters_hold(case) -> None:
    build, parameter = LYING[case]
    with pytest.raises(InvalidParameterError) as refused:
        plain_params(build())
    assert refused.value.parameter == parameter


def test_plain_params_is_the_requests_own_copy() -> None:
    params = SamplingParams(max_tokens=4, stop=["a"], stop_token_ids=[3], seed=5)
    plain = plain_params(params)
    assert type(plain) is SamplingParams and plain == params
    assert isinstance(params.stop, list) and params.stop_token_ids is not None
    params.stop.append("b")
    params.stop_token_ids.append(4)
    assert plain.stop == ["a"] and plain.stop_token_ids == [3]  # later changes change nothing
    assert type(plain_params(Unchecked(max_tokens=3))) is SamplingParams


async def test_unchecked_parameters_are_refused_at_the_call_and_the_engine_serves_on(tiny_models, hf_greedy) -> None:
    path, hf = tiny_models["llama"]
    expected = hf_greedy(hf, GOOD, 8)
    async with AsyncEngine.from_pretrained(path, **BASE) as engine:
        neighbour = asyncio.create_task(engine.generate(GOOD, SamplingParams(max_tokens=8, ignore_eos=True)))
        for case, (build, parameter) in LYING.items():
            for call in (lambda p: engine.generate(GOOD, p), lambda p: engine.stream(GOOD, p).__anext__()):
                with pytest.raises(InvalidParameterError) as refused:
                    await call(build())
                assert refused.value.parameter == parameter, case
        assert (await neighbour).token_ids == expected
        # What the caller changes after the call does not reach the request in flight.
        params = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[0])
        running = asyncio.create_task(engine.generate(GOOD, params))
        await asyncio.sleep(0)
        assert params.stop_token_ids is not None
        params.stop_token_ids[:] = expected[:1]  # would stop it at its first token
        assert (await running).token_ids == expected
    assert engine.kv_stats().used_blocks == 0
