"""Tool-call formats native to model families' chat templates, and the choice of one per loaded model.

:func:`tool_format` looks once at a loaded model's chat template (and its vocabulary, for the format's
marker token) and returns the :class:`~asyncinfer.server.tools.ToolFormat` its family was trained on:

- :class:`Llama3JsonFormat` for Llama 3.1 / 3.2 / 3.3 templates (a template that opens turns with
  ``<|start_header_id|>``, knows ``tools`` and answers them under the ``ipython`` role): the template
  itself describes the tools (it is given them as ``tools``) and renders the history's calls and results
  (``tool`` messages). A call is the JSON object ``{"name": ..., "parameters": {...}}``, the whole reply,
  or after ``<|python_tag|>``; several may follow one another separated by ``;``. A forced call is one
  object (these templates hold one call per assistant message).
- :class:`MistralFormat` for Mistral templates (v0.3 / Nemo style: ``[AVAILABLE_TOOLS]`` and
  ``[TOOL_CALLS]``) whose vocabulary has ``[TOOL_CALLS]`` as one token (else Hermes): the template describes the tools and renders the history; calls are written as
  ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``. These templates refuse call ids
  that are not 9 letters or digits, so this format's calls get such ids, and any other id a client sends
  back in its history is mapped to one (the same for a call and for the result naming it).
- :data:`~asyncinfer.server.tools.HERMES` for every other template (Qwen2/Qwen3's, and the templates that
  know nothing of tools, such as the default SmolLM2's).

A marker (``<|python_tag|>``, ``[TOOL_CALLS]``) is a special token in these families' vocabularies, left out
of the reply's text like any special token: a reply whose text begins with the call's JSON (a ``{`` for
Llama, a ``[`` for Mistral) is read as calls, and so is the text after the marker where the marker is text.
A forced reply's grammar writes the marker as its token where the vocabulary has it as one token.

:class:`JsonCallStream` reads a reply in either syntax, as :class:`~asyncinfer.server.tools.CallStream`
reads the Hermes one, under the same rules: with ``"auto"`` a value is a call only once it is whole and
names an offered tool with an object of arguments (then it is sent as one piece); if the first is not, the
whole reply is content; a later one that is not ends the calls; without ``parallel_tool_calls`` only the
first call is kept. With ``"required"`` or a named function the grammar writes the calls, so each call opens
as soon as its name is written and its arguments go out as they are generated.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Callable
from typing import Any

from asyncinfer.errors import InvalidParameterError
from asyncinfer.prompts import NO_CHAT_TEMPLATE, check_unicode
from asyncinfer.server.tools import (
    HERMES,
    CallStreamBase,
    ReplyStream,
    ToolFormat,
    ToolUse,
    openai_call_id,
    partial_tag,
)
from asyncinfer.structured import StructuredOutput

__all__ = ["LLAMA_MARKER", "MISTRAL_MARKER", "JsonCallStream", "Llama3JsonFormat", "MistralFormat", "ToolFormats",
           "as_mistral_id", "mistral_id", "render_chat", "render_chat_text", "tool_format"]

LLAMA_MARKER = "<|python_tag|>"
MISTRAL_MARKER = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_WHITESPACE = " \t\r\n"


def tool_format(tokenizer: Any) -> ToolFormat:
    """The tool format of a model with ``tokenizer`` (None: a model without one), from its chat template."""
    from asyncinfer.models.tokenizer import chat_template_of

    template = chat_template_of(tokenizer)
    if template is None:
        return HERMES
    if MISTRAL_MARKER in template and "[AVAILABLE_TOOLS]" in template:
        marker = _single_token(tokenizer, MISTRAL_MARKER)
        # A vocabulary without [TOOL_CALLS] as one token was not trained on Mistral's calls (its family's
        # vocabularies all hold it): the model would have to spell the marker in pieces it never saw.
        return MistralFormat(marker) if marker is not None else HERMES
    if "<|start_header_id|>" in template and "ipython" in template and "tools" in template:
        return Llama3JsonFormat()
    return HERMES


class ToolFormats:
    """Each served model's tool format (:func:`tool_format`), chosen once per loaded version of it: a swap to
    a new version chooses again, from the new version's template."""

    def __init__(self) -> None:
        self._chosen: dict[str, tuple[int, ToolFormat]] = {}

    def of(self, model: str, version_id: int, tokenizer: Callable[[], Any]) -> ToolFormat:
        """The format of version ``version_id`` of ``model`` (``tokenizer()``: its tokenizer, read on the first call)."""
        held = self._chosen.get(model)
        if held is None or held[0] != version_id:
            held = self._chosen[model] = (version_id, tool_format(tokenizer()))
        return held[1]


def render_chat(tokenizer: Any, fmt: ToolFormat, history: list[dict[str, Any]], use: ToolUse | None) -> list[int]:
    """The prompt's token ids for a format whose template renders tools and history (``fmt.renders_history``):
    :func:`render_chat_text` encoded without special tokens added, as the engine encodes a rendered chat."""
    return list(tokenizer.encode(render_chat_text(tokenizer, fmt, history, use), add_special_tokens=False))


def render_chat_text(tokenizer: Any, fmt: ToolFormat, history: list[dict[str, Any]], use: ToolUse | None) -> str:
    """The prompt's text for a format whose template renders tools and history: the checked history as the
    template reads it (:meth:`ToolFormat.template_messages`), the offered tools as its ``tools`` (none with
    ``use`` None), the generation prompt added. Raises :class:`InvalidParameterError` on ``prompt`` (the body's
    ``messages``) for what the template refuses and for text that is not valid Unicode."""
    from asyncinfer.models.tokenizer import chat_template_of, render_chat

    if chat_template_of(tokenizer) is None:
        raise InvalidParameterError("prompt", "chat messages", NO_CHAT_TEMPLATE)

    try:
        text = render_chat(tokenizer, fmt.template_messages(history), tools=fmt.template_tools(use),
                           add_generation_prompt=True)  # on the render budget (models.template_budget)
    # The template is the model's code: whatever it raises (its own checks with jinja2's raise_exception, e.g.
    # roles out of order, or any other error) means it refuses these messages, the caller's error.
    except Exception as exc:  # noqa: BLE001 - see above
        raise InvalidParameterError("prompt", "chat messages",
                                    f"messages this model's chat template accepts ({exc})") from None
    check_unicode("prompt", text)
    return str(text)


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of the one token ``text`` is in the vocabulary (None when it takes several)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ids[0] if len(ids) == 1 else None


def mistral_id() -> str:
    """A call id as Mistral's templates take them: 9 letters or digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def as_mistral_id(call_id: str) -> str:
    """``call_id`` itself when it is 9 letters or digits, else 9 of them derived from it (always the same)."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ALNUM))
        out.append(_ALNUM[digit])
    return "".join(out)


class Llama3JsonFormat(ToolFormat):
    """Llama 3.x's JSON tool calling (the module docstring)."""

    name = "llama3_json"
    renders_history = True

    def structured(self, use: ToolUse) -> StructuredOutput:
        return StructuredOutput.grammar(f"start: %json {json.dumps(use.call_schemas('parameters'), ensure_ascii=False)}\n")

    def stream(self, use: ToolUse) -> ReplyStream:
        return JsonCallStream(use, LLAMA_MARKER, listed=False, arguments="parameters", new_id=openai_call_id)


class MistralFormat(ToolFormat):
    """Mistral's ``[TOOL_CALLS]`` lists (the module docstring); ``marker_token``: the id of ``[TOOL_CALLS]``
    when the vocabulary has it as one token (a forced reply's grammar writes that token)."""

    name = "mistral"
    renders_history = True

    def __init__(self, marker_token: int | None) -> None:
        self.marker_token = marker_token

    def structured(self, use: ToolUse) -> StructuredOutput:
        marker = json.dumps(MISTRAL_MARKER) if self.marker_token is None else f"<[{self.marker_token}]>"
        calls = 'call (", " call)*' if use.parallel else "call"
        return StructuredOutput.grammar(
            f'start: {marker} " "? "[" {calls} "]"\n'
            f"call: %json {json.dumps(use.call_schemas('arguments'), ensure_ascii=False)}\n")

    def stream(self, use: ToolUse) -> ReplyStream:
        return JsonCallStream(use, MISTRAL_MARKER, listed=True, arguments="arguments", new_id=mistral_id)

    def template_messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The history with every call id as the template takes it (:func:`as_mistral_id`): a call without
        one gets one from its place in the history."""
        out = []
        for i, message in enumerate(history):
            if message["role"] == "tool":
                message = {**message, "tool_call_id": as_mistral_id(message["tool_call_id"])}
            elif "tool_calls" in message:
                message = {**message, "tool_calls": [
                    {**call, "id": as_mistral_id(call["id"] if call["id"] is not None else f"{i}.{j}")}
                    for j, call in enumerate(message["tool_calls"])]}
            out.append(message)
        return out


# ------------------------------------------------------------------ reading a reply
class _ValueEnd:
    """Where one JSON value ends, in a text scanned piece by piece (each character once): brackets counted
    outside strings, nothing parsed. A scalar ends at the first character that cannot continue it."""

    def __init__(self) -> None:
        self.started = False
        self.depth = 0
        self.string = False
        self.escape = False
        self.scalar = False

    def scan(self, text: str, start: int) -> int | None:
        """Scan ``text[start:]``; the index just past the value's end, or None while it has not ended."""
        for i in range(start, len(text)):
            c = text[i]
            if not self.started:
                if c in _WHITESPACE:
                    continue
                self.started = True
                if c in "{[":
                    self.depth = 1
                elif c == '"':
                    self.string = True
                else:
                    self.scalar = True
                continue
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:
                if c in ",}];" or c in _WHITESPACE:
                    return i
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class JsonCallStream(CallStreamBase):
    """One choice's text in a JSON call syntax, turned into OpenAI stream deltas as it comes (:meth:`feed`, then
    :meth:`finish`); the deltas are :class:`~asyncinfer.server.tools.CallStream`'s.

    ``marker`` opens the calls where it is text (content before it); a reply whose text begins (after
    whitespace) with the calls' first character opens them too. ``listed``: the calls are one JSON list
    (Mistral), else JSON objects one after another, ``;`` between them (Llama). ``arguments``: the key of a
    call's arguments (``"parameters"`` also read as ``"arguments"``). ``new_id``: a new call's id.
    """

    def __init__(self, use: ToolUse, marker: str, *, listed: bool, arguments: str, new_id: Callable[[], str]) -> None:
        super().__init__(use, new_id)  # phases: content | open | value | args | close | next | plain | over
        self.marker = marker
        self.listed = listed
        self.key = arguments
        self._header = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "' + arguments + '": ')
        self._text = ""  # the whole reply so far
        self._at = 0  # how far it is read
        self._sent = 0  # how much of it went out as content
        self._lead = True  # nothing but whitespace so far (calls may open with their first character)
        self._value_at = 0  # where the value being read began
        self._scan = _ValueEnd()

    def _take(self, text: str) -> None:
        self._text += text

    def _mark(self) -> int:
        return self._at

    def _held(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        # (a forced call's arguments went out as they came: nothing of them is held)
        if self._phase in ("content", "plain") or (not self.called and self._phase not in ("args", "over")):
            if len(self._text) > self._sent:  # held text, or a first value never whole: all of it content
                out.append({"content": self._text[self._sent:]})
            self._sent = len(self._text)
        return out

    # ------------------------------------------------------------------ steps
    def _step(self, out: list[dict[str, Any]]) -> None:
        text, at = self._text, self._at
        if self._phase == "plain":
            if len(text) > self._sent:
                out.append({"content": text[self._sent:]})
            self._sent = self._at = len(text)
        elif self._phase == "content":
            self._content(out)
        elif self._phase == "open":  # where the calls begin: a list's "[" (Mistral), or the first call
            at = _skip(text, at)
            if at == len(text):
                self._at = at
            elif not self.listed:
                self._at = at
                self._phase = "value"
                self._start_value()
            elif text[at] == "[":
                self._at = at + 1
                self._phase = "value"
                self._start_value()
            else:
                self._phase = "plain"
        elif self._phase == "value":
            self._value(out)
        elif self._phase == "args":
            end = self._scan.scan(text, at)
            stop = len(text) if end is None else end
            if stop > at:
                out.append(self._arguments(text[at:stop]))
            self._at = stop
            if end is not None:
                self._phase = "close"
        elif self._phase == "close":  # after a forced call's arguments: the call's own brace
            at = _skip(text, at)
            if at < len(text):
                self._at = at + 1
                self._phase = "next" if text[at] == "}" else "over"
            else:
                self._at = at
        elif self._phase == "next":
            self._next()
        else:  # over: nothing more is sent
            self._at = len(text)

    def _content(self, out: list[dict[str, Any]]) -> None:
        text = self._text
        if self._lead:
            at = _skip(text, self._at)
            self._at = at
            if at == len(text):
                return  # only whitespace yet: held
            rest = text[at:]
            if not self.marker.startswith(rest) and not rest.startswith(self.marker):  # (no marker, whole or begun)
                if text[at] == ("[" if self.listed else "{"):  # (the whitespace before the calls is no content)
                    self._phase = "open"
                    return
                self._lead = False
        found = text.find(self.marker, max(self._sent, self._at - len(self.marker)))
        if found >= 0:
            if found > self._sent:
                out.append({"content": text[self._sent:found]})
            self._sent = found
            self._at = found + len(self.marker)
            self._phase = "open"
            return
        if self._lead:  # only the marker's beginning yet, after whitespace: held, read again with what comes
            return
        end = len(text) - partial_tag(text, self.marker)
        if end > self._sent:
            out.append({"content": text[self._sent:end]})
            self._sent = end
        self._at = len(text)

    def _start_value(self) -> None:
        self._scan = _ValueEnd()
        self._value_at = self._at

    def _value(self, out: list[dict[str, Any]]) -> None:
        """Inside a value that may be a call: open a forced one by its name, or wait for the value's end."""
        text = self._text
        # the whitespace before the value is skipped once: read again from the value's first place at every piece,
        # a reply of whitespace after "[" or ";" cost each piece a Python loop over all of it (quadratic, on the
        # event loop: 4,000 pieces of 8 spaces took 9 s)
        start = self._value_at = _skip(text, self._value_at)
        if self.use.forced:
            header = self._header.match(text, start)
            if header is not None and header.group(1) in self.use.names():
                out.append(self._open(header.group(1)))
                self._at = self._value_at = header.end()
                self._scan = _ValueEnd()
                self._phase = "args"
                return
        end = self._scan.scan(text, self._at)
        if end is None:
            self._at = len(text)
            return
        self._at = end
        call = self._call(text[self._value_at:end])
        if call is not None:
            out.append(self._open(call[0]))
            out.append(self._arguments(call[1]))
            self._phase = "next"
        elif not self.called:  # the first value is no call: the reply is all content, from here on too
            self._phase = "plain"
        else:  # a later value is no call: the calls end here
            self._phase = "over"

    def _next(self) -> None:
        """After a call: the next one (``,`` in a list, ``;`` or nothing between objects), or the end."""
        text = self._text
        at = _skip(text, self._at)
        if at == len(text):
            self._at = at
            return
        more = text[at] == "," if self.listed else text[at] in ";{"
        if not more or not self.use.parallel:
            self._phase = "over"
            return
        self._at = at + 1 if text[at] in ",;" else at
        self._phase = "value"
        self._start_value()

    def _call(self, value: str) -> tuple[str, str] | None:
        """A whole value as a call of an offered tool: its name and its arguments' JSON (None if it is none)."""
        try:
            call = json.loads(value)
        except (ValueError, RecursionError):  # what the model wrote: any text, nested as deep as it likes
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in self.use.names():
            return None
        arguments = call.get(self.key, call.get("arguments", call.get("parameters", {})))
        if not isinstance(arguments, dict):
            return None
        return call["name"], json.dumps(arguments, ensure_ascii=False)


def _skip(text: str, at: int) -> int:
    """The index of the first character at or after ``at`` that is not whitespace (``len(text)`` if none)."""
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at
