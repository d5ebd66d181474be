"""Adversarial pass 6: faults found on the HTTP side and fixed."""

from __future__ import annotations

import pytest

from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import CHAT_BODY, decode_json, parse_chat

BAD = b"h\xc0\xafi"  # an overlong "/": not UTF-8

# Invalid UTF-8 in a key a message or a content part is not read for (skipped unread by the decoder, so never
# checked as UTF-8): the body was answered 200, where the same bytes in a field read (or an escaped lone surrogate in
# the same key) were a 400 naming the field.
SKIPPED = [  # (body, param)
    (b'{"messages": [{"role": "user", "content": "hi", "name": "' + BAD + b'"}]}', "messages.[0]"),
    (b'{"messages": [{"role": "user", "content": "hi", "' + BAD + b'": 1}]}', "messages.[0]"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "name": ["' + BAD + b'"]}]}',
     "messages.[1]"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": "' + BAD + b'"}]}]}',
     "messages.[0].content.[0]"),
]


@pytest.mark.parametrize(("body", "param"), SKIPPED, ids=[str(i) for i in range(len(SKIPPED))])
def test_invalid_utf8_in_a_key_skipped_unread_is_a_400_naming_its_object(body, param) -> None:
    with pytest.raises(APIError) as refused:
        parse_chat(decode_json(body, CHAT_BODY))
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.message
    assert "UTF-8" in refused.value.message


def test_valid_utf8_in_a_skipped_key_is_still_skipped() -> None:
    body = '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hé", "x": "wörld"}], "name": "zoë"}]}'
    parsed = parse_chat(decode_json(body.encode(), CHAT_BODY))
    assert parsed.messages == [{"role": "user", "content": "hé"}]
