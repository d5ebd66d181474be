"""A stop string or a request id holding a lone surrogate ("\\ud800") is a typed error naming it, as a prompt's is.

No text a model writes holds one, so such a stop string was accepted and could never stop anything; a request id
holding one was accepted and written as it is into logs and answers (UTF-8 streams refuse it there).
"""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu"}


@pytest.mark.parametrize("stop", ["\ud800", ["fine", "a\udfffb"]])
def test_a_stop_string_with_a_lone_surrogate_is_refused_naming_stop(stop) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(stop=stop)
    assert caught.value.parameter == "stop" and "lone surrogate" in str(caught.value)


def test_a_stop_string_of_valid_unicode_is_kept() -> None:
    assert SamplingParams(stop=["é", "\U0001f600"]).stop == ["é", "\U0001f600"]


async def test_a_request_id_with_a_lone_surrogate_is_refused_and_the_engine_serves_on(tiny_models) -> None:
    engine = await AsyncEngine.load(tiny_models["llama"][0], **BASE)
    async with engine:
        with pytest.raises(InvalidParameterError) as caught:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="req-\udc00")
        assert caught.value.parameter == "request_id"
        with pytest.raises(InvalidParameterError):
            async for _ in engine.stream([5, 6, 7], SamplingParams(max_tokens=2), request_id="\ud800"):
                pass
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id="req-é")
        assert out.num_output_tokens == 2
