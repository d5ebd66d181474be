"""An eighteenth adversarial pass over the HTTP server: each finding held to its fix."""

from __future__ import annotations

import json
from typing import ClassVar

import httpx
import pytest

from asyncinfer.outputs import Logprob
from asyncinfer.server.responses import Reply
from asyncinfer.server.tools import CallStream, parse_tool_use, read_calls
from tests.helpers import gather_tool_deltas

#: Characters of two, three and four UTF-8 bytes: the tiny model's byte-level BPE (trained on ASCII text) has no
#: token for any of them, so each is written one byte-token at a time, and no such token decodes alone.
WIDE = "é€😀"


def _chat(live_url: str, stream: bool) -> tuple[str, list[dict]]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say it"}], "max_tokens": 40,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "guided_choice": [WIDE], "stream": stream}
    with httpx.Client(base_url=live_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            return choice["message"]["content"], choice["logprobs"]["content"]
        text, tokens = "", []
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
                    tokens += (choice["logprobs"] or {}).get("content") or []
        return text, tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_logprobs_bytes_are_the_tokens_own_bytes(server, stream) -> None:
    """OpenAI's ``bytes`` of a chat logprob are the token's UTF-8 bytes, there so that a client can join the
    tokens of a character split over several of them. Each was the bytes of the token decoded alone, which for a
    piece of a character is U+FFFD: ``[239, 191, 189]``, whatever the token, so the joined bytes of a reply of
    one emoji read three replacement characters. They are now the token's own bytes, for the chosen tokens and
    their alternatives."""
    pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")
    text, tokens = _chat(server.url, stream)
    assert text == WIDE
    pieces = [t for t in tokens if t["token"] != "</s>"]  # the EOS that ends the reply is a token of no text
    assert len(pieces) == 9  # one byte a token: 2 + 3 + 4
    assert b"".join(bytes(t["bytes"]) for t in pieces) == WIDE.encode("utf-8")
    assert all(t["token"] == "\ufffd" and len(t["bytes"]) == 1 for t in pieces)
    for token in pieces:
        for alternative in token["top_logprobs"]:
            if alternative["token"] == "\ufffd":  # a byte of no character of its own
                assert len(alternative["bytes"]) == 1 and alternative["bytes"][0] >= 0x80, alternative
            else:
                assert bytes(alternative["bytes"]) == alternative["token"].encode("utf-8")


class _FallbackTokenizer:
    """A SentencePiece-style vocabulary: ``▁hi`` and the byte-fallback pieces ``<0xE2>``, ``<0x82>``, ``<0xAC>``
    (the three bytes of "€"), each of which decodes alone to U+FFFD."""

    pieces: ClassVar[dict[int, str]] = {0: "▁hi", 1: "<0xE2>", 2: "<0x82>", 3: "<0xAC>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        (token_id,) = ids
        return " hi" if token_id == 0 else "\ufffd"

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_byte_fallback_pieces_give_their_byte() -> None:
    reply = Reply(chat=True, id="chatcmpl-x", created=0, model="m", tokenizer=_FallbackTokenizer(), want_logprobs=True)
    logprobs = [Logprob(i, -0.5, [(i, -0.5), (0, -1.0)]) for i in (0, 1, 2, 3)]
    content = reply.choice(0, " hi€", logprobs, "stop")["logprobs"]["content"]
    assert [t["bytes"] for t in content] == [[32, 104, 105], [0xE2], [0x82], [0xAC]]
    assert b"".join(bytes(t["bytes"]) for t in content).decode("utf-8") == " hi€"
    assert [[a["bytes"] for a in t["top_logprobs"]] for t in content] == [
        [[32, 104, 105], [32, 104, 105]], [[0xE2], [32, 104, 105]], [[0x82], [32, 104, 105]], [[0xAC], [32, 104, 105]]]


def test_the_default_models_vocabulary_gives_an_emojis_bytes_token_by_token(real_gguf) -> None:
    """The default model's tokenizer (byte-level BPE, the GGUF file's cached tokenizer): every token of an emoji
    and a CJK character that decodes alone to U+FFFD gives its own bytes, and the bytes of all of them join into
    the text."""
    from asyncinfer.models.loader import gguf_tokenizer

    tokenizer = gguf_tokenizer(real_gguf)
    text = "🦙 蜥蜴 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    reply = Reply(chat=True, id="chatcmpl-x", created=0, model="m", tokenizer=tokenizer, want_logprobs=True)
    content = reply.choice(0, text, [Logprob(i, -1.0) for i in ids], "stop")["logprobs"]["content"]
    assert any(t["token"] == "\ufffd" for t in content)  # the text is split inside characters
    assert b"".join(bytes(t["bytes"]) for t in content) == text.encode("utf-8")


ROLL = {"type": "function", "function": {"name": "roll_dice", "parameters": {
    "type": "object", "properties": {"count": {"type": "integer"}, "sides": {"type": "integer"}}}}}
NEST = {"type": "function", "function": {"name": "nest", "parameters": {
    "type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}}}
DICE_CALL = '<tool_call>\n{"name": "roll_dice", "arguments": {"count": 2, "sides": 6}}\n</tool_call>'
ARGS = '{"count": 2, "sides": 6}'


@pytest.mark.parametrize("cut", range(1, len("}\n</tool_call>")))
def test_a_reply_cut_after_a_constrained_calls_arguments_keeps_them_whole(cut) -> None:
    """A reply cut (``max_tokens``, a stop string) after a forced call's arguments, inside the ``}\\n</tool_call>``
    that closes the call, gave the call the closing's beginning as arguments (``{"city": "Paris"}}\\n</``, which
    does not parse) and said it was cut inside the call. The arguments are whole: they are sent as written, and
    the reply is not cut inside a call. Streamed in pieces of any size, the same."""
    forced = parse_tool_use([ROLL, NEST], "required", None)
    text = DICE_CALL[: DICE_CALL.index(ARGS) + len(ARGS) + cut]
    content, calls, inside = read_calls(text, forced)
    assert (content, [c["function"] for c in calls], inside) == (None, [{"name": "roll_dice", "arguments": ARGS}], False)
    for size in (1, 2, 3, len(text)):
        stream = CallStream(forced)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
        assert gather_tool_deltas(deltas)[1][0]["function"]["arguments"] == ARGS, size
        assert not stream.in_call


def test_a_reply_cut_at_its_arguments_own_brace_still_sends_it() -> None:
    """The brace that may begin the call's closing is the arguments' own where they are not whole without it."""
    forced = parse_tool_use([ROLL, NEST], "required", None)
    head = '<tool_call>\n{"name": "nest", "arguments": '
    _content, [call], inside = read_calls(head + '{"a": {"b": 1}', forced)  # the inner object's brace
    assert (call["function"]["arguments"], inside) == ('{"a": {"b": 1}', True)
    _content, [call], inside = read_calls(head + '{"a": {"b": 1}}', forced)  # the arguments' own last brace
    assert (call["function"]["arguments"], inside) == ('{"a": {"b": 1}}', False)
    _content, [call], inside = read_calls(head + '{"a": {"b": 1}}}\n</tool', forced)
    assert (call["function"]["arguments"], inside) == ('{"a": {"b": 1}}', False)
