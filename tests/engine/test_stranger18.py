"""A newcomer's first hour with the Python API (stranger 18): each finding held to its fix."""

from __future__ import annotations

import asyncio

import pytest
import trio

from asyncinfer import (
    AsyncEngine,
    EmbeddingConfig,
    EngineConfig,
    EngineState,
    InvalidParameterError,
    SamplingParams,
    WrongEventLoopError,
    trim_messages,
)


def test_with_instead_of_async_with_says_async_with(tiny_models) -> None:
    """``with engine:`` (``async`` forgotten) was Python's bare ``TypeError: 'AsyncEngine' object does
    not support the context manager protocol``, which does not say the engine is an async one."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=64, num_threads=1)
    with pytest.raises(TypeError) as caught, engine:
        pass
    assert str(caught.value) == (
        "AsyncEngine is an asynchronous context manager: use 'async with engine:' inside an async function "
        "(or 'await engine.start()' and 'await engine.aclose()'), not 'with engine:'")
    assert engine.state is EngineState.CREATED  # nothing was started


def test_a_call_after_the_starting_loop_closed_says_so(tiny_models) -> None:
    """``asyncio.run(engine.start())`` then ``asyncio.run(engine.generate(...))``: the second call was told
    to use ``asyncio.run_coroutine_threadsafe(..., engine.loop)``, a loop that has closed and runs nothing."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=64, num_threads=1)
    asyncio.run(engine.start())
    assert engine.loop is not None and engine.loop.is_closed()

    async def use() -> None:
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))

    with pytest.raises(WrongEventLoopError) as caught:
        asyncio.run(use())
    assert str(caught.value) == (
        "the event loop this engine was started on has closed (the asyncio.run() that started it has ended): an "
        "engine serves on one loop for its whole life, so start and use it within one asyncio.run() (e.g. "
        "'async with engine:' in your main()); 'await engine.aclose()' still frees it from here")

    async def close() -> None:
        await engine.aclose()

    asyncio.run(close())  # as the message says
    assert engine.state is EngineState.CLOSED


def test_another_running_loop_keeps_its_thread_advice(tiny_models) -> None:
    """A loop that still runs keeps the run_coroutine_threadsafe advice (the fix above is for closed loops)."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=64, num_threads=1)

    async def main() -> None:
        async with engine:
            def other() -> BaseException | None:
                try:
                    asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))
                except BaseException as exc:  # noqa: BLE001 - handed back to the test
                    return exc
                return None

            exc = await asyncio.to_thread(other)
            assert isinstance(exc, WrongEventLoopError)
            assert "asyncio.run_coroutine_threadsafe(engine.generate(...), engine.loop)" in str(exc)
            out = await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
            assert len(out.token_ids) == 2

    asyncio.run(main())


HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"}]


def test_trim_messages_refuses_engine_tokenize_for_count_tokens() -> None:
    """``trim_messages(history, budget, engine.tokenize)`` (the ids, not their count) was Python's bare
    ``TypeError: '>' not supported between instances of 'list' and 'int'``."""
    def tokenize(messages: list[dict[str, str]]) -> list[int]:
        return list(range(7 * len(messages)))

    with pytest.raises(InvalidParameterError) as caught:
        trim_messages(HISTORY, 40, tokenize)
    assert caught.value.parameter == "count_tokens" and caught.value.value is tokenize
    assert caught.value.allowed == ("a function of a message list that returns its token count (an int >= 0): "
                                    "engine.count_tokens (it returned a list of 14 items; engine.tokenize returns "
                                    "the ids themselves)")


@pytest.mark.parametrize(("count_tokens", "returned"), [
    (lambda messages: "3", "'3'"), (lambda messages: -3, "-3"), (lambda messages: 3.0, "3.0"),
    (lambda messages: True, "True"), (lambda messages: None, "None"),
])
def test_trim_messages_refuses_a_count_that_is_not_a_count(count_tokens, returned) -> None:
    """A string compared with Python's TypeError; a negative count or a float was taken as one."""
    with pytest.raises(InvalidParameterError) as caught:
        trim_messages(HISTORY, 40, count_tokens)
    assert caught.value.parameter == "count_tokens"
    assert caught.value.allowed.endswith(f"engine.count_tokens (it returned {returned})")


def test_trim_messages_refuses_a_count_tokens_that_is_no_function() -> None:
    with pytest.raises(InvalidParameterError) as caught:
        trim_messages(HISTORY, 40, 40)
    assert str(caught.value) == ("count_tokens=40 is invalid: allowed a function of a message list that returns its "
                                 "token count (an int >= 0): engine.count_tokens")


def test_trim_messages_still_trims_with_a_real_count() -> None:
    words = lambda messages: sum(len(m["content"].split()) + 2 for m in messages)  # noqa: E731
    assert trim_messages(HISTORY, 9, words) == [HISTORY[0], HISTORY[3]]
    assert trim_messages(HISTORY, 100, words) == HISTORY


def test_sampling_params_with_updates_is_the_documented_copy() -> None:
    """docs/api.md names ``with_updates`` (a newcomer tried ``dataclasses.replace`` and setting a field)."""
    params = SamplingParams(max_tokens=4, temperature=0.5, stop=["x"])
    with pytest.raises(AttributeError, match="immutable type"):
        params.max_tokens = 8
    changed = params.with_updates(max_tokens=8)
    assert (changed.max_tokens, changed.temperature, changed.stop, params.max_tokens) == (8, 0.5, ["x"], 4)
    with pytest.raises(InvalidParameterError) as caught:
        params.with_updates(max_new_tokens=8)
    assert caught.value.parameter == "max_new_tokens" and caught.value.allowed.startswith(
        "a SamplingParams field: max_tokens, temperature, ")
    with pytest.raises(InvalidParameterError) as caught:
        params.with_updates(max_tokens=0)
    assert str(caught.value) == "max_tokens=0 is invalid: allowed an int >= 1"


def test_start_under_trio_names_asyncio_and_the_guide(tiny_models) -> None:
    """``async with engine:`` under trio was asyncio's bare ``RuntimeError: no running event loop``."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=64, num_threads=1)

    async def main() -> None:
        async with engine:
            pass

    with pytest.raises(WrongEventLoopError) as caught:
        trio.run(main)
    assert isinstance(caught.value, RuntimeError)  # still what asyncio raised
    assert str(caught.value) == (
        "the engine runs on asyncio only, and no asyncio event loop runs here (trio, or anyio's trio backend?): run "
        "it on an asyncio loop in a thread of its own (docs/guides/trio.md)")
    assert engine.state is EngineState.CREATED  # nothing started: it can still be started on asyncio

    async def on_asyncio() -> list[int]:
        async with engine:
            return (await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))).token_ids

    assert len(asyncio.run(on_asyncio())) == 2


@pytest.mark.parametrize("args", [(), ("SmolLM2-135M-Instruct",)])
def test_constructing_an_engine_directly_names_from_pretrained(args) -> None:
    """``AsyncEngine("SmolLM2-135M-Instruct")`` / ``AsyncEngine()`` were Python's ``takes 1 positional argument``
    and ``missing 1 required keyword-only argument: 'config'``, naming neither from_pretrained nor load."""
    with pytest.raises(TypeError) as caught:
        AsyncEngine(*args)
    assert str(caught.value) == ("an AsyncEngine is built by AsyncEngine.from_pretrained(model, **options) or, in a "
                                 "coroutine, 'await AsyncEngine.load(model, **options)', not by AsyncEngine(...)")


def test_aclose_abort_during_a_drain_aborts_it(tiny_models) -> None:
    """The shutdown pattern ``wait_for(engine.aclose(), timeout)``, then ``aclose(abort=True)`` on the timeout:
    the second call waited for the drain (every request ran to its max_tokens) instead of aborting."""
    engine = AsyncEngine.from_pretrained(tiny_models["llama"][0], max_model_len=512, num_threads=1)

    async def main() -> tuple[str | None, int, EngineState]:
        await engine.start()
        long = asyncio.create_task(engine.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True)))
        while not engine.step_stats().decode_tokens:  # decoding
            await asyncio.sleep(0.01)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.aclose(), 0.05)
        assert engine.state is EngineState.CLOSING
        await asyncio.wait_for(engine.aclose(abort=True), 30)
        out = await long
        return out.finish_reason, len(out.token_ids), engine.state

    finish, tokens, state = asyncio.run(main())
    assert finish == "abort" and tokens < 500 and state is EngineState.CLOSED


@pytest.mark.parametrize("keyword", ["config", "engine_config"])
def test_an_engine_config_passed_as_a_keyword_says_options_are_keywords(tiny_models, keyword) -> None:
    """``from_pretrained(model, config=EngineConfig(...))`` listed the known options and no more."""
    with pytest.raises(InvalidParameterError) as caught:
        AsyncEngine.from_pretrained(tiny_models["llama"][0], **{keyword: EngineConfig(max_model_len=64)})
    assert caught.value.parameter == keyword
    assert caught.value.allowed.endswith(
        f"; {keyword} has no asyncinfer option: the options are keywords themselves, of every call that takes them "
        "(from_pretrained, load, plan_memory, swap_model, add_model): from_pretrained(model, max_model_len=..., ...), "
        "or from_pretrained(model, **options) with a dict of them")


@pytest.mark.parametrize(("keyword", "hint"), [
    ("config", ("the options are keywords themselves, of every call that takes them (from_pretrained, load, "
                "plan_memory, swap_model, add_model): from_pretrained(model, max_seq_len=..., ...), or "
                "from_pretrained(model, **options) with a dict of them")),
    ("trust_remote_code", "asyncinfer runs no model code of its own (its own model classes only)"),
])
def test_an_embedding_model_s_config_passed_as_a_keyword_says_options_are_keywords(minilm_dir, keyword, hint) -> None:
    """``add_model(name, encoder, config=EmbeddingConfig(...))`` (or ``plan_memory``, ``from_pretrained``) listed the
    known options and no more: the hint was given for a generator's options only, and names an encoder's option."""
    with pytest.raises(InvalidParameterError) as caught:
        AsyncEngine.plan_memory(minilm_dir, **{keyword: EmbeddingConfig(max_seq_len=64)})
    assert caught.value.parameter == keyword
    assert caught.value.allowed.endswith(f"; {keyword} has no asyncinfer option: {hint}")


@pytest.mark.real_model
def test_min_tokens_defers_stop_strings_as_its_docstring_now_says(real_gguf) -> None:
    """A stop string completed before ``min_tokens`` tokens is not matched later (the docstring named only EOS and
    ``stop_token_ids``): greedy, the default model writes ' Paris.' in its first two tokens."""
    engine = AsyncEngine.from_pretrained(real_gguf, max_model_len=128, num_threads=1)

    async def main() -> list[tuple[str, str | None]]:
        async with engine:
            outs = [await engine.generate("The capital of France is", SamplingParams(max_tokens=8, stop=".", **kw))
                    for kw in ({}, {"min_tokens": 3})]
        return [(out.text, out.finish_reason) for out in outs]

    plain, deferred = asyncio.run(main())
    assert plain == (" Paris", "stop")
    assert deferred[1] == "length" and deferred[0].startswith(" Paris.")
    assert "``stop`` strings are looked for only from then on" in SamplingParams.__doc__
