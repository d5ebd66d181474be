"""A stranger's first hour (stranger31): a prompt of ``max_model_len`` tokens or more is a ``PromptTooLongError``
whichever way it is found too long. Token ids were refused as one by their count, a text or a chat by its tokens as
a plain ``InvalidParameterError`` with the same message, so ``except PromptTooLongError:`` (trim, then retry)
missed the common case: a text or a chat history that tokenizes past the context."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, PromptTooLongError, SamplingParams

OPTIONS = {"max_model_len": 64, "device": "cpu", "num_threads": 1}


@pytest.fixture
async def engine(real_gguf):
    async with await AsyncEngine.load(real_gguf, **OPTIONS) as engine:  # the default model: it has a tokenizer
        yield engine


async def test_a_text_chat_or_ids_past_the_context_is_a_prompt_too_long_error(engine) -> None:
    text = "hello world " * 40
    chat = [{"role": "user", "content": text}]
    assert engine.count_tokens(text) >= 64 and engine.count_tokens(chat) >= 64  # tokenized, not refused unread
    for prompt in (text, chat, list(range(5, 70))):
        with pytest.raises(PromptTooLongError) as err:
            await engine.generate(prompt, SamplingParams(max_tokens=4))
        assert err.value.parameter == "prompt" and err.value.allowed == "at most max_model_len - 1 = 63 tokens"
        with pytest.raises(PromptTooLongError):
            async for _ in engine.stream(prompt, SamplingParams(max_tokens=4)):
                pass
    assert engine.num_unfinished_requests == 0


async def test_room_for_the_prompt_but_not_max_tokens_stays_a_refusal_of_max_tokens(engine) -> None:
    with pytest.raises(InvalidParameterError) as err:
        await engine.generate(list(range(5, 55)), SamplingParams(max_tokens=15))
    assert err.value.parameter == "max_tokens" and not isinstance(err.value, PromptTooLongError)
