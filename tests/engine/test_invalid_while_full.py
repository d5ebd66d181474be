"""A request no retry can run is refused as invalid (400) whatever the load: every check of its own arguments comes
before admission control's, so a full engine never answers it as overloaded (503 with Retry-After)."""

from __future__ import annotations

import asyncio

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, PromptTooLongError, SamplingParams

BASE = {"kv_cache_memory": 4 * 1024 * 1024, "max_model_len": 128, "dtype": "float32", "device": "cpu", "block_size": 4}


async def test_a_bad_tenant_version_or_token_id_prompt_is_invalid_while_the_engine_is_full(tiny_models) -> None:
    """``max_num_seqs=1, max_waiting_requests=0`` with a request in flight: a bad ``tenant`` or ``version_id``, a
    token-id prompt past ``max_model_len``, with an id past the vocabulary, or empty, or leaving no room for
    ``max_tokens``, each was refused as :class:`EngineOverloadedError` (checked after the load), and counted so."""
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=0) as engine:
        busy = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        cases = [
            ({"tenant": ""}, [5, 6], InvalidParameterError, "tenant"),
            ({"version_id": -1}, [5, 6], InvalidParameterError, "version_id"),
            ({}, list(range(5, 205)), PromptTooLongError, "prompt"),
            ({}, [10**7], InvalidParameterError, "prompt"),
            ({}, [], InvalidParameterError, "prompt"),
            ({"max_tokens": 100}, list(range(5, 105)), InvalidParameterError, "max_tokens"),
        ]
        for kwargs, prompt, error, parameter in cases:
            params = SamplingParams(max_tokens=kwargs.pop("max_tokens", 2))
            with pytest.raises(error) as err:
                await engine.generate(prompt, params, **kwargs)
            assert err.value.parameter == parameter
        assert engine.num_unfinished_requests == 1  # it was full all along
        rejected = engine.metrics.snapshot().models["default"].rejected
        await busy
    assert rejected == {"invalid": len(cases), "overloaded": 0}


async def test_a_good_request_is_still_refused_as_overloaded_while_the_engine_is_full(tiny_models) -> None:
    """The order changed nothing for a request that may run later: a text or token ids, it is overloaded."""
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=0) as engine:
        busy = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        from asyncinfer import EngineOverloadedError

        for prompt in ([5, 6], "hello"):
            with pytest.raises(EngineOverloadedError):
                await engine.generate(prompt, SamplingParams(max_tokens=2), tenant="t", version_id=None)
        await busy
        out = await engine.generate([5, 6], SamplingParams(max_tokens=2), tenant="t")
    assert len(out.outputs[0].token_ids) == 2


async def test_check_request_refuses_what_generate_would_whatever_the_load(tiny_models) -> None:
    """``check_request`` runs the checks no retry could pass, and admits nothing: for a caller counting places of
    its own (the HTTP server's per-tenant limit) before it submits."""
    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=0) as engine:
        busy = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        cases = [
            ([5, 10**7], None, InvalidParameterError, "prompt"),
            (list(range(5, 205)), None, PromptTooLongError, "prompt"),
            ([5, 6], SamplingParams(max_tokens=2, stop_token_ids=[10**7]), InvalidParameterError, "stop_token_ids"),
            ([5, 6], SamplingParams(max_tokens=2, n=2, temperature=1.0), InvalidParameterError, "n"),
            ("x" * 10**6, None, PromptTooLongError, "prompt"),
            ([5, 6], "greedy", InvalidParameterError, "params"),
        ]
        for prompt, params, error, parameter in cases:
            with pytest.raises(error) as err:
                engine.check_request(prompt, params)
            assert err.value.parameter == parameter
        engine.check_request([5, 6], SamplingParams(max_tokens=2))  # the engine is full: no matter here
        engine.check_request("hello", SamplingParams(max_tokens=2))
        assert engine.num_unfinished_requests == 1
        rejected = engine.metrics.snapshot().models["default"].rejected
        await busy
    # nothing was submitted, but each refusal is the engine's admission refusing a request, as a caller's 400 (the
    # server's at a tenant's limit): counted (stranger67; it was counted nowhere)
    assert rejected == {"invalid": len(cases), "overloaded": 0}


async def test_a_max_tokens_no_prompt_leaves_room_for_is_invalid_while_the_engine_is_full(tiny_models) -> None:
    """A text or chat asking ``max_tokens >= max_model_len``: no prompt (one token at least) leaves room for it, but
    a text is tokenized only once admitted, so a full engine refused it as :class:`EngineOverloadedError` (503 with
    Retry-After, and over HTTP a 429 at the tenant's limit) and ``check_request`` let it by; with
    ``truncate_output_to_model_len`` it is a request that may run later."""
    from asyncinfer import EngineOverloadedError

    async with AsyncEngine.from_pretrained(tiny_models["llama"][0], **BASE, max_num_seqs=1,
                                           max_waiting_requests=0) as engine:
        busy = asyncio.ensure_future(engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0)
        chat = [{"role": "user", "content": "hi"}]
        for prompt in ("hello", chat):
            for max_tokens in (128, 10**6):
                params = SamplingParams(max_tokens=max_tokens)
                with pytest.raises(InvalidParameterError) as err:
                    engine.check_request(prompt, params)
                assert (err.value.parameter, err.value.value) == ("max_tokens", max_tokens)
                assert err.value.allowed.startswith("at most max_model_len - 1 = 127 (")
                with pytest.raises(InvalidParameterError) as err:
                    await engine.generate(prompt, params)
                assert err.value.parameter == "max_tokens"
        engine.check_request("hello", SamplingParams(max_tokens=127))  # fits a one-token prompt: may run later
        with pytest.raises(EngineOverloadedError):
            await engine.generate("hello", SamplingParams(max_tokens=128, truncate_output_to_model_len=True))
        rejected = engine.metrics.snapshot().models["default"].rejected
        await busy
    assert rejected == {"invalid": 4 + 4, "overloaded": 1}  # check_request's refusals, then generate's
