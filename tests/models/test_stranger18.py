"""A newcomer's first hour (stranger 18): ``engine.get_tokenizer()`` for a GGUF file (a ``CachedTokenizer``) refuses
transformers' options it does not do, rather than ignore them and return something else."""

from __future__ import annotations

import pytest

from asyncinfer import InvalidParameterError
from asyncinfer.models.loader import gguf_tokenizer
from asyncinfer.models.tokenizer import CachedTokenizer

pytestmark = pytest.mark.real_model

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(real_gguf) -> CachedTokenizer:
    tokenizer = gguf_tokenizer(real_gguf)
    assert isinstance(tokenizer, CachedTokenizer)
    return tokenizer


@pytest.mark.parametrize(("option", "value", "default"), [
    ("return_tensors", "pt", None),             # a list came back where a tensor was used
    ("return_dict", True, False),               # a list came back where out["input_ids"] was read
    ("continue_final_message", True, False),    # the last message came back closed
    ("padding", "max_length", False),
    ("truncation", True, False),
    ("max_length", 8, None),
])
def test_apply_chat_template_refuses_what_it_does_not_do(tok, option, value, default) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        tok.apply_chat_template(CHAT, add_generation_prompt=True, **{option: value})
    assert caught.value.parameter == option and caught.value.value == value
    assert caught.value.allowed == (f"{default!r} (the default) in CachedTokenizer.apply_chat_template: a GGUF file's "
                                    "cached tokenizer returns plain lists of ids and does the defaults of "
                                    "transformers' options only")


@pytest.mark.parametrize(("option", "value"), [("return_tensors", "pt"), ("padding", True), ("truncation", True),
                                               ("max_length", 4), ("return_offsets_mapping", True)])
def test_call_refuses_what_it_does_not_do(tok, option, value) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        tok("hello world", **{option: value})
    assert caught.value.parameter == option and "CachedTokenizer.__call__" in caught.value.allowed


def test_the_defaults_spelled_out_are_taken(tok) -> None:
    """Code written for transformers passes the defaults by name: the same ids as without them."""
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors=None, return_dict=False,
                                   continue_final_message=False, padding=False, truncation=False) == ids
    plain = tok("hello world")
    assert plain == {"input_ids": tok.encode("hello world")}
    assert tok("hello world", return_tensors=None, padding="do_not_pad", truncation=False, max_length=None) == plain
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n")  # other keywords are the template's, as in transformers
