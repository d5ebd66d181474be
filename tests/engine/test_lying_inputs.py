"""Inputs whose ``__len__`` lies cannot slip past a limit (issue 25, the last adversarial pass).

A ``str`` or ``list`` subclass may say it holds 1 item (or none) while it holds a million. Every
check used to ask it: a huge text passed the characters check and was tokenized on the caller's
event loop, a chat of thousands of messages ran the template on the loop, ``tokenize()`` handed
back more ids than ``max_model_len``, and a stop list past ``MAX_STOP_STRINGS`` (or a stop string
past ``MAX_STOP_CHARS``) was taken. The engine's calls and ``SamplingParams`` now read such values
as the built-in ``str``/``list``/``dict`` they hold before any check (``prompts.plain_prompt``).
"""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams
from asyncinfer.prompts import MAX_CHAT_MESSAGES, MAX_EMBED_TEXTS, check_texts, plain_prompt
from asyncinfer.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.helpers import TemplateSpy

ONE = SamplingParams(max_tokens=1)


class LyingStr(str):
    """Says it holds one character; ``str()`` of it says "x"."""

    def __len__(self) -> int:
        return 1

    def __str__(self) -> str:
        return "x"


class LyingList(list):
    """Says it holds one item, and iterating it gives only the first."""

    def __len__(self) -> int:
        return 1

    def __iter__(self):
        return iter(list.__getitem__(self, slice(0, 1)))


class EmptyList(list):
    """Says it holds nothing."""

    def __len__(self) -> int:
        return 0


# ------------------------------------------------------------------ without a model
def test_a_stop_list_or_string_that_lies_about_its_length_is_held_to_the_limits() -> None:
    for many in (LyingList(["a"] * (MAX_STOP_STRINGS + 1)), EmptyList(["a"] * (MAX_STOP_STRINGS + 1))):
        with pytest.raises(InvalidParameterError) as err:
            SamplingParams(stop=many)
        assert err.value.parameter == "stop" and f"<{MAX_STOP_STRINGS + 1} strings>" == err.value.value
    long = LyingStr("y" * (MAX_STOP_CHARS + 1))
    for stop in (long, [long], EmptyList(["ab", long])):
        with pytest.raises(InvalidParameterError) as err:
            SamplingParams(stop=stop)
        assert err.value.parameter == "stop" and f"{MAX_STOP_CHARS} characters" in err.value.allowed
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(stop_token_ids=EmptyList([1] * (MAX_STOP_TOKEN_IDS + 1)))
    assert err.value.parameter == "stop_token_ids" and err.value.value == f"<{MAX_STOP_TOKEN_IDS + 1} ids>"
    # Within the limits they are kept as the built-in values they hold: the stop check sees what was checked.
    p = SamplingParams(stop=LyingList(["ab", LyingStr("cd")]), stop_token_ids=LyingList([5, 6]))
    assert p.stop == ["ab", "cd"] and type(p.stop) is list and all(type(s) is str for s in p.stop)
    assert p.stop_strings == ("ab", "cd") and p.stop_token_ids == [5, 6] and type(p.stop_token_ids) is list
    q = SamplingParams(stop=LyingStr("zz"))
    assert q.stop == "zz" and type(q.stop) is str and q.with_updates(max_tokens=3).stop == "zz"


def test_plain_prompt_reads_what_a_value_holds() -> None:
    assert plain_prompt(LyingStr("hello")) == "hello" and type(plain_prompt(LyingStr("hello"))) is str
    ids = plain_prompt(LyingList([3, 4, 5]))
    assert ids == [3, 4, 5] and type(ids) is list
    chat = plain_prompt(EmptyList([{"role": LyingStr("user"), "content": LyingStr("hi there")}]))
    assert chat == [{"role": "user", "content": "hi there"}] and all(type(v) is str for v in chat[0].values())
    assert plain_prompt(b"ab") == b"ab" and plain_prompt(range(3)) == range(3)  # refused later, as before


def test_embed_texts_that_lie_about_their_count_are_held_to_the_limit() -> None:
    with pytest.raises(InvalidParameterError) as err:
        check_texts(LyingList(["a"] * (MAX_EMBED_TEXTS + 1)))
    assert err.value.parameter == "texts"
    texts = check_texts(EmptyList(["a", LyingStr("bc")]))
    assert texts == ["a", "bc"] and all(type(t) is str for t in texts)


# ------------------------------------------------------------------ the real tokenizer
@pytest.mark.real_model
async def test_prompts_and_messages_that_lie_about_their_length_are_refused_by_what_they_hold(
        real_gguf, monkeypatch) -> None:
    async with await AsyncEngine.load(real_gguf, max_model_len=256) as engine:
        spy = TemplateSpy(engine.tokenizer)
        monkeypatch.setattr(engine.tokenizer, "apply_chat_template", spy)
        # A text: refused by its characters, untokenized, at the call (it was tokenized on the loop).
        huge = LyingStr("word " * 40_000)
        for call in (lambda: engine.tokenize(huge), lambda: engine.stream(huge, ONE)):
            with pytest.raises(InvalidParameterError) as err:
                call()
            assert err.value.parameter == "prompt" and err.value.value == "<200000 characters>"
        # Token ids: tokenize() handed back 300 ids for a model of 256 positions.
        ids = LyingList([(7 * j) % 300 + 3 for j in range(300)])
        with pytest.raises(InvalidParameterError) as err:
            engine.tokenize(ids)
        assert err.value.parameter == "prompt" and err.value.value == "<300 tokens>"
        # Chat messages: the count limit, and a message whose content lies about its length.
        flood = LyingList([{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1))
        for call in (lambda: engine.count_tokens(flood), lambda: engine.apply_chat_template(flood),
                     lambda: engine.stream(flood, ONE)):
            with pytest.raises(InvalidParameterError) as err:
                call()
            assert err.value.parameter == "prompt" and err.value.value == f"<{MAX_CHAT_MESSAGES + 1} chat messages>"
        long_message = [{"role": "user", "content": LyingStr("word " * 40_000)}]
        with pytest.raises(InvalidParameterError) as err:
            engine.count_tokens(long_message)
        assert err.value.value == "<200004 characters>"  # with its role's characters
        assert spy.threads == []  # the template never ran
        # What holds little is served as what it holds, not as its __str__ says.
        out = await engine.generate(LyingStr("Hello"), ONE)
        assert out.prompt_token_ids == engine.tokenize("Hello")
