"""Function tools over HTTP: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body.

What a body asks is checked here whatever the model (:func:`parse_tool_use`, :func:`check_tool_calls`);
how the tools are described to the model, how its history's calls and results are rendered, the grammar
of a forced call and how a reply is read back are a :class:`ToolFormat`'s, chosen once per loaded model
from its chat template (:mod:`asyncinfer.server.tool_formats`: Llama 3.x's JSON calls, Mistral's
``[TOOL_CALLS]``) and held by the request's :class:`ToolUse`.

This module holds the format every other model gets, :data:`HERMES` (Hermes/Qwen's, which many open
models are trained on, and which a template that knows nothing of tools, the default SmolLM2's, gets
too): the tools are described to the model in a system message (their JSON signatures inside
``<tools></tools>``), and a call is written as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
History is rendered the same way, whatever the model's chat template: an assistant message's ``tool_calls``
become such blocks in its text, a ``tool`` message becomes a user message holding
``<tool_response>...</tool_response>``, and the messages go through the model's own template as text.

With ``tool_choice`` ``"required"`` or a named function, decoding is constrained (a Lark grammar
holding the calls' JSON schema, :meth:`ToolUse.structured`) so that the reply *is* a valid call;
with ``"auto"`` the reply is parsed for calls the model chose to write (:func:`split_calls`).
:class:`CallStream` turns a streamed reply into OpenAI's ``delta.content`` / ``delta.tool_calls``
pieces as it is generated, and :func:`split_calls` is what it sends, gathered: the two never differ
(each format's stream, :meth:`ToolUse.stream`, keeps the same promise).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from asyncinfer.errors import InvalidParameterError
from asyncinfer.grammar import schema_refusal
from asyncinfer.server.errors import APIError, shown
from asyncinfer.structured import StructuredOutput

__all__ = ["HERMES", "CallStream", "CallStreamBase", "HermesFormat", "ReplyStream", "Tool", "ToolFormat", "ToolUse",
           "check_tool_calls", "hermes_messages", "openai_call_id", "parse_tool_use", "partial_tag", "read_calls",
           "render_assistant", "render_tool_result", "split_calls"]

MAX_TOOLS = 128  # OpenAI's limit on `tools`
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (fullmatch: no final newline)
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
#: How JSON is written in a constrained call (as ``StructuredOutput`` writes JSON: one line, json.dumps's separators).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_PROMPT = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return "
    "a JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


#: keywords whose value is JSON data, not a schema (a ``$ref`` key in them is no reference)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
#: keywords whose value maps names to schemas (a name there, ``$ref`` or ``const``, is no keyword)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, base: str, names: bool = False) -> Any:
    """``schema`` (or, with ``names``, a map of names to schemas) with each local JSON-pointer reference (``$ref``
    or ``$dynamicRef`` of ``#`` or ``#/...``) moved under the pointer ``base``, for the schema placed there in a
    larger one; data (``const``, ``enum``, ...) and other references (``$anchor`` names, URIs) as they were."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if names:
            out[key] = _rebased(value, base)
        elif key in ("$ref", "$dynamicRef") and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = f"#{base}{value[1:]}"
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base, key in _SCHEMA_MAPS)
    return out


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and JSON-schema parameters."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def signature(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}

    def call_schema(self, arguments: str = "arguments", at: str = "") -> dict[str, Any]:
        """The JSON schema of one call of this tool: ``{"name": <its name>, <arguments>: <its parameters>}``
        (the key of the arguments is the format's: ``arguments``, or Llama's ``parameters``), placed at the JSON
        pointer ``at`` of the schema it is part of: the parameters' local ``$ref``s (``#/$defs/...``, as pydantic
        writes them) are rebased to where the parameters now lie (they named the whole call's root, and were
        refused as 'Pointer does not exist')."""
        parameters = _rebased(self.parameters, f"{at}/properties/{arguments}")
        return {"type": "object", "properties": {"name": {"const": self.name}, arguments: parameters},
                "required": ["name", arguments], "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """A chat body's tools and how they may be used: ``choice`` is ``"auto"``, ``"required"`` or a tool's name;
    ``format`` is the loaded model's :class:`ToolFormat` (:data:`HERMES` until the server binds the model's own,
    :meth:`bound`)."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool
    format: ToolFormat = field(default_factory=lambda: HERMES)

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model is told of (only the named one when ``tool_choice`` names one)."""
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    @property
    def forced(self) -> bool:
        """``tool_choice`` is ``"required"`` or a named function: the reply is constrained to calls."""
        return self.choice != "auto"

    def bound(self, fmt: ToolFormat) -> ToolUse:
        """The same tools in the model's format ``fmt``."""
        return ToolUse(self.tools, self.choice, self.parallel, fmt)

    def system_prompt(self) -> str:
        return _PROMPT.format(tools="\n".join(json.dumps(t.signature(), ensure_ascii=False) for t in self.offered))

    def with_prompt(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the tools described as the Hermes format does: in the first system message, or in a
        new one before all."""
        prompt = self.system_prompt()
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def structured(self) -> StructuredOutput | None:
        """With ``"required"`` or a named tool: the grammar of the reply in the format's syntax (one call, or
        several when ``parallel`` and the format allows them); with ``"auto"``, None (the model may answer in
        text)."""
        return self.format.structured(self) if self.forced else None

    def stream(self) -> ReplyStream:
        """A reply's reader in the format's syntax (:class:`ReplyStream`)."""
        return self.format.stream(self)

    def call_schemas(self, arguments: str) -> dict[str, Any]:
        """The JSON schema of one call of an offered tool, its arguments under the key ``arguments``, written
        as a constrained call is (one line, json.dumps's separators)."""
        offered = self.offered
        schemas = ([offered[0].call_schema(arguments)] if len(offered) == 1 else
                   [t.call_schema(arguments, f"/anyOf/{i}") for i, t in enumerate(offered)])
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema["x-guidance"] = _JSON_STYLE
        return schema

    def names(self) -> set[str]:
        return {t.name for t in self.offered}

    def refused_tool(self) -> tuple[str, str] | None:
        """The first offered tool whose ``parameters`` llguidance refuses on their own (no arguments satisfy them, say),
        with its reason; None when each is taken alone. Blocking: a compile's work for each tool."""
        for tool in self.offered:
            reason = schema_refusal(tool.parameters)
            if reason is not None:
                return tool.name, reason
        return None


class ReplyStream(Protocol):
    """One choice's text turned into OpenAI stream deltas as it comes (:class:`CallStream` is the Hermes one):
    ``{"content": ...}`` or ``{"tool_calls": [...]}`` pieces, a call opening with its ``index``, ``id``, ``type``
    and ``function.name`` (``arguments: ""``), then pieces of its ``function.arguments`` under the same index."""

    def feed(self, text: str) -> list[dict[str, Any]]: ...

    def finish(self) -> list[dict[str, Any]]: ...

    @property
    def called(self) -> bool: ...

    @property
    def in_call(self) -> bool: ...


class ToolFormat(ABC):
    """How one model family is told of tools, writes its calls and reads its history: chosen once per loaded
    model (:func:`asyncinfer.server.tool_formats.tool_format`) and held by the request's :class:`ToolUse`."""

    #: The format's name, as the docs give it ("hermes", "llama3_json", "mistral").
    name: ClassVar[str]
    #: True: the model's chat template renders the tools and the history's calls and results itself
    #: (:meth:`template_messages`, :meth:`template_tools`); False: they are written into the messages' text
    #: (the Hermes way) and the template sees plain messages.
    renders_history: ClassVar[bool]

    @abstractmethod
    def structured(self, use: ToolUse) -> StructuredOutput:
        """The grammar of a forced reply (``tool_choice`` "required" or named) in the format's syntax."""

    @abstractmethod
    def stream(self, use: ToolUse) -> ReplyStream:
        """A reader of one reply."""

    def template_messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The checked history (:func:`asyncinfer.server.protocol.chat_history`) as the family's template reads it."""
        return history

    def template_tools(self, use: ToolUse | None) -> list[dict[str, Any]] | None:
        """The ``tools`` the template is given (None: no tool may be called)."""
        return None if use is None else [t.signature() for t in use.offered]


class HermesFormat(ToolFormat):
    """Hermes/Qwen's ``<tool_call>`` blocks, described in a system message (the module docstring)."""

    name = "hermes"
    renders_history = False

    def structured(self, use: ToolUse) -> StructuredOutput:
        schema = use.call_schemas("arguments")
        grammar = ("start: call" + (' ("\\n" call)*' if use.parallel else "") + "\n"
                   f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
                   f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")
        return StructuredOutput.grammar(grammar)

    def stream(self, use: ToolUse) -> ReplyStream:
        return CallStream(use)


#: The Hermes format: every model whose template is not one of :mod:`asyncinfer.server.tool_formats`' families.
HERMES = HermesFormat()


def parse_tool_use(tools: Any, tool_choice: Any, parallel: Any) -> ToolUse | None:
    """The body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked; None when no tool may be
    called (no tools, or ``tool_choice: "none"``). A 400 naming the field for anything malformed."""
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"`parallel_tool_calls` must be a boolean, got {shown(parallel)}.")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"`tools` must be a list of at most {MAX_TOOLS} function tools.")
    checked = tuple(_tool(tool, f"tools.[{i}]") for i, tool in enumerate(tools))
    names = [t.name for t in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise _bad("tools", f"`tools` names the function {shown(duplicate)} more than once.")
    choice = _choice(tool_choice, bool(checked), set(names))
    if choice == "none" or not checked:
        return None
    return ToolUse(checked, choice, parallel is not False)


def _tool(tool: Any, where: str) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(where, f'`{where}` must be {{"type": "function", "function": {{"name": ..., ...}}}}.')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{where}.function.name", f"`{where}.function.name` must be 1 to 64 letters, digits, '_' or '-', "
                                             f"got {shown(name)}.")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description", f"`{where}.function.description` must be a string.")
    parameters = function.get("parameters")
    if parameters is None:  # OpenAI's "empty parameter list": no argument at all, not any object the model writes
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters", f"`{where}.function.parameters` must be a JSON schema (an object).")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"{where}.function.strict", f"`{where}.function.strict` must be a boolean.")
    try:
        StructuredOutput.json_schema(parameters)  # its shape: string keys, finite numbers, bounded size
    except InvalidParameterError as exc:
        raise _bad(f"{where}.function.parameters", f"`{where}.function.parameters` is not a usable JSON schema: "
                                                   f"{exc.allowed}") from None
    return Tool(name, description, parameters)


def _choice(value: Any, have_tools: bool, names: set[str]) -> str:
    if value is None:
        return "auto" if have_tools else "none"
    if value in ("none", "auto", "required"):
        if value == "required" and not have_tools:
            raise _bad("tool_choice", '`tool_choice` "required" needs `tools`.')
        return str(value)
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if not isinstance(name, str) or name not in names:  # (a list or an object is no name: unhashable too)
            raise _bad("tool_choice", f"`tool_choice` names the function {shown(name)}, which is not in `tools`.")
        return str(name)
    raise _bad("tool_choice", '`tool_choice` must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}.')


# ------------------------------------------------------------------ history
def check_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, checked, as chat templates read them: ``{"id": <its id, or
    None>, "type": "function", "function": {"name": ..., "arguments": <the arguments' JSON, decoded>}}``."""
    if not isinstance(tool_calls, list):
        raise _bad(f"{where}.tool_calls", f"`{where}.tool_calls` must be a list of tool calls.")
    checked = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls.[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(at, f'`{at}` must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           '"arguments": ...}}.')
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{at}.id", f"`{at}.id` must be a string.")
        if call.get("type", "function") != "function":  # read as a function call whatever it named
            raise _bad(f"{at}.type", f'`{at}.type` must be "function", got {shown(call["type"])}.',
                       "unsupported_parameter")
        raw = function.get("arguments", "{}")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except (ValueError, RecursionError):  # a string: the body's depth check never saw inside it
            raise _bad(f"{at}.function.arguments", f"`{at}.function.arguments` must be a JSON string.") from None
        checked.append({"id": call_id, "type": "function", "function": {"name": function["name"],
                                                                        "arguments": arguments}})
    return checked


def render_assistant(content: str, tool_calls: Any, where: str) -> str:
    """An assistant message's text with its ``tool_calls`` written as ``<tool_call>`` blocks (Hermes)."""
    return _hermes_text(content, check_tool_calls(tool_calls, where))


def _hermes_text(content: str, calls: list[dict[str, Any]]) -> str:
    blocks = []
    for call in calls:
        call_json = json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                               ensure_ascii=False)
        blocks.append(f"{OPEN}\n{call_json}\n{CLOSE}")
    return "\n".join([content, *blocks] if content else blocks)


def render_tool_result(content: str) -> dict[str, str]:
    """A ``tool`` message (a call's result) as the user message that carries it (Hermes)."""
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def hermes_messages(history: list[dict[str, Any]]) -> list[dict[str, str]]:
    """A checked history (``tool_calls`` as :func:`check_tool_calls` gives them, ``tool`` messages with their
    ``tool_call_id``) as the plain ``{"role", "content"}`` messages of the Hermes format."""
    out = []
    for message in history:
        if message["role"] == "tool":
            out.append(render_tool_result(message["content"]))
        elif "tool_calls" in message:
            out.append({"role": "assistant", "content": _hermes_text(message["content"], message["tool_calls"])})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


# ------------------------------------------------------------------ replies
def openai_call_id() -> str:
    """A new call's id as OpenAI writes them: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(block: str, names: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except (ValueError, RecursionError):  # what the model wrote: any text, nested as deep as it likes
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": openai_call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def split_calls(text: str, use: ToolUse) -> tuple[str | None, list[dict[str, Any]]]:
    """A reply's content (the text before its first call; None if only whitespace, or if the reply was forced)
    and its tool calls.

    Exactly what :class:`CallStream` sends for the same text, gathered: ``<tool_call>`` blocks from the
    first one on are read in order; if the first is not a call of an offered tool with an object of
    arguments, there are no calls and the whole text is the content; a later block that is not one ends
    the calls (it and what follows are dropped, as is text between blocks). Without ``parallel`` only
    the first call is kept. With ``tool_choice`` ``"required"`` or a named function the arguments are
    the JSON text the model wrote (a reply cut inside a call keeps the call, its arguments cut too:
    :func:`read_calls` says so).
    """
    content, calls, _cut = read_calls(text, use)
    return content, calls


def read_calls(text: str, use: ToolUse) -> tuple[str | None, list[dict[str, Any]], bool]:
    """:func:`split_calls`, and whether the text ends inside a call (its arguments incomplete); in the format
    of ``use`` (what its :meth:`ToolUse.stream` sends, gathered)."""
    stream = use.stream()
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            if part["index"] == len(calls):
                calls.append({"id": part["id"], "type": part["type"], "function": dict(part["function"])})
            else:
                calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    if not calls:  # a forced reply cut before its first call opened holds nothing but the grammar's opening
        return (None if use.forced else text), [], False
    return (content if content.strip() else None), calls, stream.in_call


#: How a constrained call begins (after ``<tool_call>``): its name, then its arguments' JSON.
_HEADER = re.compile(r'\n\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
#: How a constrained call ends: the call object's brace, then the block's end.
_END = "}\n" + CLOSE


def _whole_json(text: str) -> bool:
    """Whether ``text`` is one whole JSON value (a constrained call's arguments, written to their end)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    except RecursionError:  # nested deeper than the parser goes (a constrained reply may nest that far)
        return _closed(text)
    return True


def _closed(text: str) -> bool:
    """Whether a JSON value's text (a grammar's output: valid so far) has closed every bracket it opened."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
    return depth == 0 and not in_string


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class CallStreamBase(ABC):
    """What every format's :class:`ReplyStream` shares: the phase it is in (it starts in ``"content"``; ``"args"``
    is inside a call's arguments, ``"over"`` sends nothing more), the calls it opened (their indexes are
    0 .. n - 1, each with a ``new_id()``), the deltas that open a call and carry a piece of its arguments, and
    :meth:`feed`'s loop: steps (:meth:`_step`) until one moves neither the phase nor :meth:`_mark`."""

    def __init__(self, use: ToolUse, new_id: Callable[[], str] = openai_call_id) -> None:
        self.use = use
        self.new_id = new_id
        self._phase = "content"
        self._calls = 0  # calls opened

    @property
    def called(self) -> bool:
        """At least one call was sent."""
        return self._calls > 0

    @property
    def in_call(self) -> bool:
        """A call's arguments were being sent and have not ended (the reply was cut inside a call)."""
        return self._phase == "args"

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send now for ``text``."""
        self._take(text)
        out: list[dict[str, Any]] = []
        while True:
            before = (self._phase, self._mark())
            self._step(out)
            if (self._phase, self._mark()) == before:
                return out

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still to send when the reply ends."""
        out = self._held()
        if self._phase != "args":  # (a call cut short stays `in_call`)
            self._phase = "over"
        if self.use.forced and not self.called:  # cut before its first call's name: the grammar's opening, no text
            out = [delta for delta in out if "content" not in delta]
        return out

    @abstractmethod
    def _take(self, text: str) -> None:
        """Keep ``text``, the reply's next piece, to be read."""

    @abstractmethod
    def _mark(self) -> int:
        """Where the reading stands: a step that reads anything moves it (or the phase)."""

    @abstractmethod
    def _step(self, out: list[dict[str, Any]]) -> None:
        """Read on from where the reading stands, appending the deltas that are due to ``out``."""

    @abstractmethod
    def _held(self) -> list[dict[str, Any]]:
        """At the reply's end: the deltas for what is still held."""

    def _open(self, name: str) -> dict[str, Any]:
        self._calls += 1
        return {"tool_calls": [{"index": self._calls - 1, "id": self.new_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, piece: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self._calls - 1, "function": {"arguments": piece}}]}


class CallStream(CallStreamBase):
    """One choice's text, turned into OpenAI stream deltas as it comes (:meth:`feed`, then :meth:`finish`).

    A delta is ``{"content": ...}`` or ``{"tool_calls": [...]}``: a call opens with its ``index``, ``id``,
    ``type`` and ``function.name`` (``arguments: ""``); pieces of ``function.arguments`` follow under the
    same ``index``. Text before the first ``<tool_call>`` is content as it comes (an end that may be the
    start of the tag held back). With ``tool_choice`` ``"required"`` or a named function the grammar
    writes the calls, so each call opens as soon as its name is written and its arguments go out as
    they are generated. With ``"auto"`` a block is a call only if it is whole and valid, so each block
    is held until its ``</tool_call>`` and then sent as one call (or, for a first block that is not a
    call, as content, with all that follows).
    """

    def __init__(self, use: ToolUse) -> None:
        super().__init__(use)  # phases: content | block | args | between | plain | over
        self._forced = use.forced
        self._buf = ""  # text received and not yet settled
        self._raw = ""  # everything from the first <tool_call> on (sent as content if that block is no call)
        self._args = ""  # the arguments sent of the constrained call open now

    def _take(self, text: str) -> None:
        if self._phase != "content" and self._phase != "plain":
            self._raw += text
        self._buf += text

    def _mark(self) -> int:
        return len(self._buf)  # what is settled leaves the buffer

    def _held(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._phase == "content" or self._phase == "plain":
            if self._buf:
                out.append({"content": self._buf})
        elif self._phase == "block" and not self.called:  # a first block never closed: no call, all content
            out.append({"content": self._raw})
        elif self._phase == "args" and self._buf:  # held: a beginning of the call's closing "}\n</tool_call>"
            if not _whole_json(self._args):  # the brace is the arguments' own (they end with it, or are cut)
                out.append(self._arguments(self._buf))
                self._args += self._buf
            if _whole_json(self._args):  # cut after the arguments' end: the call is whole but for its closing
                self._phase = "between"
        self._buf = ""
        return out

    # ------------------------------------------------------------------ steps
    def _step(self, out: list[dict[str, Any]]) -> None:
        if self._phase == "plain":
            if self._buf:
                out.append({"content": self._buf})
            self._buf = ""
        elif self._phase == "content":
            at = self._buf.find(OPEN)
            if at >= 0:
                head, self._buf = self._buf[:at], self._buf[at + len(OPEN):]
                self._raw = OPEN + self._buf
                self._phase = "block"
            else:
                keep = partial_tag(self._buf, OPEN)
                head, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if head:
                out.append({"content": head})
        elif self._phase == "between":
            at = self._buf.find(OPEN)
            if at >= 0:
                self._buf = self._buf[at + len(OPEN):]
                self._phase = "block" if self.use.parallel else "over"
            else:
                self._buf = self._buf[len(self._buf) - partial_tag(self._buf, OPEN):]  # text between blocks: dropped
        elif self._phase == "block":
            self._block(out)
        elif self._phase == "args":
            at = self._buf.find(_END)
            if at >= 0:
                piece, self._buf = self._buf[:at], self._buf[at + len(_END):]  # the call's own brace is not theirs
                self._phase = "between"
            else:
                keep = partial_tag(self._buf, _END)
                piece, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            if piece:
                out.append(self._arguments(piece))
                self._args += piece
        else:  # over: nothing more is sent
            self._buf = ""

    def _block(self, out: list[dict[str, Any]]) -> None:
        """Inside a ``<tool_call>`` block: open a constrained call by its name, or wait for the block's end."""
        if self._forced:
            header = _HEADER.match(self._buf)
            if header is not None and header.group(1) in self.use.names():
                out.append(self._open(header.group(1)))
                self._buf = self._buf[header.end():]
                self._phase = "args"
                self._args = ""
                return
        at = self._buf.find(CLOSE)
        if at < 0:
            return
        block, self._buf = self._buf[:at], self._buf[at + len(CLOSE):]
        call = _call(block.strip(), self.use.names())
        if call is not None:
            out.append(self._open(call["function"]["name"]))
            out.append(self._arguments(call["function"]["arguments"]))
            self._phase = "between"
        elif not self.called:  # the first block is no call: the reply is all content, from here on too
            out.append({"content": self._raw[: len(self._raw) - len(self._buf)]})
            self._phase = "plain"
        else:  # a later block is no call: the calls end here
            self._phase = "over"
            self._buf = ""
