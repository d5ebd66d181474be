"""A prompt or ``max_tokens`` refused against the model's context carries its sizes as attributes
(``PromptTooLongError.max_model_len`` / ``.prompt_tokens`` / ``.prompt_chars``; ``MaxTokensOverContextError``'s
``.max_model_len`` / ``.prompt_tokens``), so a caller (and the HTTP layer's OpenAI-worded 400) reads them instead of
parsing the error's text; each error pickles and copies with them."""

from __future__ import annotations

import copy
import pickle

import pytest

from asyncinfer import (
    AsyncEngine,
    InvalidParameterError,
    MaxTokensOverContextError,
    PromptTooLongError,
    SamplingParams,
)
from asyncinfer.prompts import MAX_CHAT_MESSAGES
from asyncinfer.server.errors import from_exception

OPTIONS = {"max_model_len": 64, "device": "cpu", "num_threads": 1}


@pytest.fixture
async def engine(real_gguf):
    async with await AsyncEngine.load(real_gguf, **OPTIONS) as engine:
        yield engine


async def refusal(engine: AsyncEngine, prompt, max_tokens: int = 4) -> InvalidParameterError:
    with pytest.raises(InvalidParameterError) as err:
        await engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
    return err.value


async def test_a_prompt_past_the_context_names_its_size_and_the_context(engine) -> None:
    text = "hello world " * 40
    err = await refusal(engine, text)
    assert type(err) is PromptTooLongError
    assert (err.max_model_len, err.prompt_tokens, err.prompt_chars) == (64, engine.count_tokens(text), None)
    err = await refusal(engine, list(range(5, 75)))  # token ids: refused by their count
    assert (err.max_model_len, err.prompt_tokens, err.prompt_chars) == (64, 70, None)
    err = await refusal(engine, "x" * 100_000)  # more characters than 63 tokens can hold: refused untokenized
    assert (err.max_model_len, err.prompt_tokens, err.prompt_chars) == (64, None, 100_000)
    chat = [{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1)  # another limit: not the context's
    err = await refusal(engine, chat)
    assert type(err) is PromptTooLongError and (err.max_model_len, err.prompt_tokens) == (None, None)
    assert engine.num_unfinished_requests == 0


async def test_max_tokens_past_the_room_is_its_own_type_with_the_prompts_tokens(engine) -> None:
    err = await refusal(engine, "hello", max_tokens=64)  # no prompt leaves room: refused before tokenizing
    assert type(err) is MaxTokensOverContextError and err.parameter == "max_tokens" and err.value == 64
    assert (err.max_model_len, err.prompt_tokens) == (64, None)
    err = await refusal(engine, list(range(5, 55)), max_tokens=15)  # 50 tokens leave 14
    assert type(err) is MaxTokensOverContextError and (err.max_model_len, err.prompt_tokens) == (64, 50)
    assert not isinstance(err, PromptTooLongError)


@pytest.mark.parametrize("rebuild", [lambda e: pickle.loads(pickle.dumps(e)), copy.copy, copy.deepcopy])
def test_the_sizes_survive_pickle_and_copies(rebuild) -> None:
    for error in (PromptTooLongError("<70 tokens>", "at most max_model_len - 1 = 63 tokens", max_model_len=64,
                                     prompt_tokens=70),
                  MaxTokensOverContextError(64, "at most max_model_len - 1 = 63", max_model_len=64, prompt_tokens=None)):
        again = rebuild(error)
        assert type(again) is type(error) and vars(again) == vars(error) and str(again) == str(error)


def test_the_http_answer_reads_the_sizes_not_the_text() -> None:
    """The 400 words the sizes the error holds; a route's own ``PromptTooLongError`` without them (its text in the
    engine's words or not) gets the plain message, never numbers parsed out of it."""
    sized = PromptTooLongError("<a long story>", "fewer tokens", max_model_len=128, prompt_tokens=300)
    answer = from_exception(sized, "req-1")
    assert answer.status == 400 and answer.message.startswith(
        "This model's maximum context length is 128 tokens (prompt and output together), and the prompt may take at "
        "most 127 of them. However, your `prompt` resulted in 300 tokens.")
    bare = from_exception(PromptTooLongError("<9000 tokens>", "at most max_model_len - 1 = 8191 tokens"), "req-2")
    assert (bare.status, bare.code) == (400, "context_length_exceeded")
    assert bare.message == "prompt=<9000 tokens> is invalid: allowed at most max_model_len - 1 = 8191 tokens"
    early = MaxTokensOverContextError(900, "at most 255", max_model_len=256, prompt_tokens=None)
    assert "the context is 256 tokens (max_model_len)" in from_exception(early, "req-3").message
