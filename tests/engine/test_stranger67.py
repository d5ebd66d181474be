"""A sixty-seventh stranger's trial, in the engine: what misled, each held to its fix."""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import AsyncEngine, EngineOverloadedError, InvalidParameterError, SamplingParams

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}


async def test_the_checks_a_caller_makes_before_it_submits_count_their_refusals(tiny_models) -> None:
    """stranger67: ``asyncinfer_rejected_requests_total`` counts the engine's admission, but a call of several prompts
    refused whole by ``check_admission`` (a 503 ``overloaded``, a 400 past what may ever be in flight) counted in no
    reason, nor did ``check_request``'s or ``taking_in``'s refusals: an overload alert missed every batch client."""
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=1) as engine:
        def rejected() -> dict[str, int]:
            return engine.metrics.snapshot().models["default"].rejected

        busy = [asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
                for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError):
            engine.check_admission(2)
        assert rejected() == {"invalid": 0, "overloaded": 1}  # once for the call
        with pytest.raises(InvalidParameterError) as err:
            engine.check_admission(3)
        assert err.value.parameter == "prompt"
        assert rejected() == {"invalid": 1, "overloaded": 1}
        with pytest.raises(EngineOverloadedError), engine.taking_in():
            pass
        assert rejected() == {"invalid": 1, "overloaded": 2}
        with pytest.raises(InvalidParameterError) as err:
            engine.check_request([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[10**6]))
        assert err.value.parameter == "stop_token_ids"
        assert rejected() == {"invalid": 2, "overloaded": 2}
        with pytest.raises(InvalidParameterError) as err:
            engine.check_request([5, 6], SamplingParams(max_tokens=2), model="nope")
        assert rejected() == {"invalid": 2, "overloaded": 2}  # a model not served: counted under no model's label
        await asyncio.gather(*busy)
        with pytest.raises(ValueError, match="the caller's own"), engine.taking_in():
            raise ValueError("the caller's own")  # what the block raises is no refusal
        engine.check_admission(2)
        assert rejected() == {"invalid": 2, "overloaded": 2}


async def test_check_prompt_size_counts_its_refusal_too(tiny_models) -> None:
    """pass75: ``check_prompt_size`` (the server's check of a streamed chat with usage, of a tools chat, and of a
    streamed completion with usage) refused without counting: the same prompt through ``generate`` counted."""
    from asyncinfer import PromptTooLongError

    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE) as engine:
        with pytest.raises(PromptTooLongError):
            engine.check_prompt_size(list(range(5, 505)))
        assert engine.metrics.snapshot().models["default"].rejected == {"invalid": 1, "overloaded": 0}
        engine.check_prompt_size([5, 6])
        assert engine.metrics.snapshot().models["default"].rejected == {"invalid": 1, "overloaded": 0}


async def test_check_prompt_size_refuses_no_prompt_and_a_closed_engine(tiny_models) -> None:
    """pass76: ``check_prompt_size(12345)`` and ``(None)`` returned as if they fitted, and a closed engine counted a
    refusal where ``check_request`` said it was closed."""
    from asyncinfer import EngineClosedError

    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE)
    async with engine:
        for prompt in (12345, None, b"hi", [], ""):  # pass77: "" passed, and a streamed completion's went uncounted
            with pytest.raises(InvalidParameterError) as err:
                engine.check_prompt_size(prompt)
            assert err.value.parameter == "prompt"
        assert engine.metrics.snapshot().models["default"].rejected == {"invalid": 5, "overloaded": 0}
    with pytest.raises(EngineClosedError):
        engine.check_prompt_size(list(range(5, 505)))
