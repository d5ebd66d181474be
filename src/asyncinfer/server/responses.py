"""Response bodies in OpenAI's formats: whole completions, stream chunks, logprobs, usage."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import msgspec

from asyncinfer.outputs import Logprob
from asyncinfer.server.tools import ReplyStream, ToolUse, read_calls


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: Any) -> bytes:
    """One Server-Sent Event carrying ``data`` as JSON."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

#: OpenAI's log-probability for a token that cannot (or almost cannot) be drawn: a number, never ``null``.
UNLIKELY_LOGPROB = -9999.0


def wire_logprob(value: float) -> float:
    """A log-probability as OpenAI writes it: ``-inf`` (a token that a structured-output constraint or the
    ``min_tokens`` mask forbids, among the ``top_logprobs`` alternatives) and anything below is
    :data:`UNLIKELY_LOGPROB`, since JSON has no infinity (it would be written ``null``, which clients that
    read the field as a number refuse)."""
    return max(UNLIKELY_LOGPROB, value)  # NaN too: max keeps the first when nothing compares greater


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


@cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's characters -> the bytes they stand for (GPT-2's ``bytes_to_unicode``, inverted): printable
    Latin-1 bytes stand for themselves, the other 68 for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


@dataclass
class Reply:
    """Builds one request's response bodies; ``chat`` picks chat.completion over text_completion."""

    chat: bool
    id: str
    created: int
    model: str
    tokenizer: Any
    want_logprobs: bool
    include_usage: bool = False
    tools: ToolUse | None = None  # chat with tools: replies are parsed for tool calls
    token_ids: bool = False  # a model without a tokenizer: its text is empty, each choice carries its `token_ids`
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: its streamed tokens' characters so far
    _calls: dict[int, ReplyStream] = field(default_factory=dict)  # per choice, with tools: its text's split

    # ----------------------------------------------------------- whole results
    def choice(self, index: int, text: str, logprobs: list[Logprob] | None, finish_reason: str,
               token_ids: Sequence[int] = ()) -> dict[str, Any]:
        body: dict[str, Any] = {"index": index}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
            if self.tools is not None:
                content, calls, cut = read_calls(text, self.tools)
                if calls:
                    body["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish_reason = "tool_calls" if finish_reason == "stop" and not cut else finish_reason
                else:  # the text, or None: a forced reply cut before its call's name (`<tool_call>\n{"na`)
                    body["message"]["content"] = content
        else:
            body["text"] = text
            if self.token_ids:
                body["token_ids"] = list(token_ids)
        body["logprobs"] = self._logprobs(index, logprobs) if self.want_logprobs else None
        body["finish_reason"] = finish_reason
        return body

    def completion(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}

    # ------------------------------------------------------------------ stream
    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def role_chunk(self, n: int) -> bytes:
        """Chat streams open with the assistant role, one choice per sample (a forced tool call's content is null,
        as its whole answer's: the reply is the calls)."""
        content = None if self.tools is not None and self.tools.forced else ""
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                            "finish_reason": None} for i in range(n)])

    def delta_chunk(self, index: int, text: str, logprobs: list[Logprob] | None, finish_reason: str | None,
                    token_ids: Sequence[int] = ()) -> bytes:
        if self.chat and self.tools is not None:
            return self._tool_chunks(self.tools, index, text, logprobs, finish_reason)
        body: dict[str, Any] = {"index": index}
        if self.chat:
            body["delta"] = {"content": text} if text or finish_reason is None else {}
        else:
            body["text"] = text
            if self.token_ids:
                body["token_ids"] = list(token_ids)
        body["logprobs"] = self._logprobs(index, logprobs or [], streamed=True) if self.want_logprobs else None
        body["finish_reason"] = finish_reason
        return self.chunk([body])

    def _tool_chunks(self, tools: ToolUse, index: int, text: str, logprobs: list[Logprob] | None,
                     finish_reason: str | None) -> bytes:
        """A chat choice with tools: its content and calls as the format's stream splits them
        (:meth:`ToolUse.stream`), one chunk per delta, the last carrying the logprobs and the finish_reason."""
        stream = self._calls.get(index)
        if stream is None:
            stream = self._calls[index] = tools.stream()
        deltas = stream.feed(text)
        if finish_reason is not None:
            deltas += stream.finish()
            if finish_reason == "stop" and stream.called and not stream.in_call:
                finish_reason = "tool_calls"
        with_logprobs = self.want_logprobs and bool(logprobs)
        if not deltas and finish_reason is None and not with_logprobs:
            return b""  # all of it held back
        if finish_reason is not None or not deltas:
            deltas.append({} if finish_reason is not None else {"content": ""})
        chunks = [self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
                  for delta in deltas[:-1]]
        last: dict[str, Any] = {"index": index, "delta": deltas[-1]}
        last["logprobs"] = self._logprobs(index, logprobs or [], streamed=True) if self.want_logprobs else None
        last["finish_reason"] = finish_reason
        return b"".join([*chunks, self.chunk([last])])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model, "choices": [],
                    "usage": usage(prompt_tokens, completion_tokens)})

    # ---------------------------------------------------------------- logprobs
    def _logprobs(self, index: int, logprobs: Sequence[Logprob] | None, streamed: bool = False) -> dict[str, Any]:
        """Legacy ``text_offset``s count the characters of the choice's tokens before each one, as its ``tokens``
        read them (single-token decodes), from its first token on, in a stream (``streamed``, the count carried
        from chunk to chunk) as in a whole answer: the same offsets either way. (A stream counted from the text
        streamed so far, which a piece of a character or a possible stop string holds back and a stop string's
        tokens never add to, so a chunk's offsets and the whole answer's parted at the first such token.)"""
        logprobs = logprobs or []
        if self.chat:
            return {"content": [
                {**self._token(lp.token_id, lp.logprob),
                 "top_logprobs": [self._token(tid, value) for tid, value in lp.top]}
                for lp in logprobs
            ]}
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets, at = [], self._offsets.get(index, 0) if streamed else 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        if streamed:
            self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [wire_logprob(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self.token_text(tid): wire_logprob(value) for tid, value in lp.top}
                                 for lp in logprobs],
                "text_offset": offsets}

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": wire_logprob(logprob), "bytes": list(self.token_bytes(token_id, text))}

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The token's own UTF-8 bytes (OpenAI's ``bytes``, which a client joins to rebuild a character split over
        several tokens). ``text``, the token decoded alone, holds them unless it is a piece of a character, which
        decodes to U+FFFD: then its bytes are read from its vocabulary entry, a byte-level BPE piece (GPT-2's
        byte-to-character table) or a byte-fallback piece (``<0xE2>``), and ``text``'s own bytes where it is
        neither."""
        if "\ufffd" not in text or self.tokenizer is None:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            byte = _BYTE_FALLBACK.fullmatch(piece)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            table = _byte_level_table()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
        return text.encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token as text (``token_id:<id>`` for a model without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
