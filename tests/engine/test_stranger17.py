"""A newcomer's first hour with the Python API (stranger 17): each finding held to its fix."""

from __future__ import annotations

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("text", ["hi", b"hi"])
def test_apply_chat_template_names_a_text_whole(real_gguf, text) -> None:
    """``engine.apply_chat_template("hi")`` iterated the text and refused its first character:
    ``prompt[0]='h' is invalid: allowed a dict with string 'role' and 'content'``."""
    engine = AsyncEngine.from_pretrained(real_gguf, max_model_len=256, num_threads=1)
    with pytest.raises(InvalidParameterError) as caught:
        engine.apply_chat_template(text)
    assert caught.value.parameter == "prompt" and caught.value.value == text
    assert str(caught.value) == (f"prompt={text!r} is invalid: allowed a list of chat messages ({{'role': ..., "
                                 "'content': ...}); tokenize() takes a text as it is")
    messages = [{"role": "user", "content": "hi"}]
    assert engine.apply_chat_template(messages) == engine.tokenize(messages)
