"""Function tools over HTTP: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body.

One format for every model, the Hermes/Qwen one that many open models are trained on: the tools
are described to the model in a system message (their JSON signatures inside ``<tools></tools>``),
and a call is written as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. History
is rendered the same way, whatever the model's chat template: an assistant message's ``tool_calls``
become such blocks in its text, a ``tool`` message becomes a user message holding
``<tool_response>...</tool_response>``. So a model whose template knows nothing of tools (the
default SmolLM2) still gets them, through its own template.

With ``tool_choice`` ``"required"`` or a named function, decoding is constrained (a Lark grammar
holding the calls' JSON schema, :meth:`ToolUse.structured`) so that the reply *is* a valid call;
with ``"auto"`` the reply is parsed for calls the model chose to write (:func:`split_calls`), and
:class:`CallStream` does the same for a stream.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from asyncinfer.errors import InvalidParameterError
from asyncinfer.server.errors import APIError
from asyncinfer.structured import StructuredOutput

__all__ = ["CallStream", "Tool", "ToolUse", "parse_tool_use", "render_assistant", "render_tool_result",
           "split_calls"]

MAX_TOOLS = 128  # OpenAI's limit on `tools`
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
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

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call of this tool: ``{"name": <its name>, "arguments": <its parameters>}``."""
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """A chat body's tools and how they may be used: ``choice`` is ``"auto"``, ``"required"`` or a tool's name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the model is told of (only the named one when ``tool_choice`` names one)."""
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def system_prompt(self) -> str:
        return _PROMPT.format(tools="\n".join(json.dumps(t.signature(), ensure_ascii=False) for t in self.offered))

    def with_prompt(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the tools described: in the first system message, or in a new one before all."""
        prompt = self.system_prompt()
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def structured(self) -> StructuredOutput | None:
        """With ``"required"`` or a named tool: the grammar of the reply (one call, or several when
        ``parallel``); with ``"auto"``, None (the model may answer in text)."""
        if self.choice == "auto":
            return None
        offered = self.offered
        schema = offered[0].call_schema() if len(offered) == 1 else {"anyOf": [t.call_schema() for t in offered]}
        schema["x-guidance"] = _JSON_STYLE
        grammar = ("start: call" + (' ("\\n" call)*' if self.parallel else "") + "\n"
                   f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
                   f"body: %json {json.dumps(schema, ensure_ascii=False)}\n")
        return StructuredOutput.grammar(grammar)

    def names(self) -> set[str]:
        return {t.name for t in self.offered}


def parse_tool_use(tools: Any, tool_choice: Any, parallel: Any) -> ToolUse | None:
    """The body's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked; None when no tool may be
    called (no tools, or ``tool_choice: "none"``). A 400 naming the field for anything malformed."""
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"`parallel_tool_calls` must be a boolean, got {parallel!r}.")
    if tools is None:
        tools = []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad("tools", f"`tools` must be a list of at most {MAX_TOOLS} function tools.")
    checked = tuple(_tool(tool, f"tools.[{i}]") for i, tool in enumerate(tools))
    names = [t.name for t in checked]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise _bad("tools", f"`tools` names the function {duplicate!r} more than once.")
    choice = _choice(tool_choice, bool(checked), set(names))
    if choice == "none" or not checked:
        return None
    return ToolUse(checked, choice, parallel is not False)


def _tool(tool: Any, where: str) -> Tool:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise _bad(where, f'`{where}` must be {{"type": "function", "function": {{"name": ..., ...}}}}.')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{where}.function.name", f"`{where}.function.name` must be 1 to 64 letters, digits, '_' or '-', "
                                             f"got {name!r}.")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"{where}.function.description", f"`{where}.function.description` must be a string.")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
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
        if name not in names:
            raise _bad("tool_choice", f"`tool_choice` names the function {name!r}, which is not in `tools`.")
        return str(name)
    raise _bad("tool_choice", '`tool_choice` must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}.')


# ------------------------------------------------------------------ history
def render_assistant(content: str, tool_calls: Any, where: str) -> str:
    """An assistant message's text with its ``tool_calls`` written as ``<tool_call>`` blocks."""
    if not isinstance(tool_calls, list):
        raise _bad(f"{where}.tool_calls", f"`{where}.tool_calls` must be a list of tool calls.")
    blocks = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls.[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(at, f'`{at}` must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                           '"arguments": ...}}}}.')
        raw = function.get("arguments", "{}")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise _bad(f"{at}.function.arguments", f"`{at}.function.arguments` must be a JSON string.") from None
        call_json = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"{OPEN}\n{call_json}\n{CLOSE}")
    return "\n".join([content, *blocks] if content else blocks)


def render_tool_result(content: str) -> dict[str, str]:
    """A ``tool`` message (a call's result) as the user message that carries it."""
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


# ------------------------------------------------------------------ replies
def _call(block: str, names: set[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def split_calls(text: str, use: ToolUse) -> tuple[str | None, list[dict[str, Any]]]:
    """A reply's content (the text before its first call; None if only whitespace) and its tool calls.

    Calls are the ``<tool_call>`` blocks from the first one on; if any of them is not a call of an offered
    tool with an object of arguments, there are none and the whole text is the content. Without
    ``parallel`` only the first call is kept.
    """
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = [_call(block, use.names()) for block in _BLOCK.findall(text, start)]
    if not calls or any(c is None for c in calls):
        return text, []
    head = text[:start]
    return (head if head.strip() else None), [c for c in calls if c is not None][: None if use.parallel else 1]


class CallStream:
    """One streamed choice's text, split as :func:`split_calls` splits a whole reply: text before the
    first ``<tool_call>`` goes out as content as it comes (a possible start of the tag held back); from
    the tag on, the text is kept and parsed when the reply ends."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self._held = ""  # text not yet sent: a possible start of OPEN, or everything from OPEN on
        self._in_calls = False
        self._sent = ""

    def feed(self, text: str) -> str:
        """The content to send now for ``text``."""
        self._held += text
        if self._in_calls:
            return ""
        at = self._held.find(OPEN)
        if at >= 0:
            self._in_calls = True
            out, self._held = self._held[:at], self._held[at:]
        else:
            keep = next((k for k in range(min(len(OPEN) - 1, len(self._held)), 0, -1)
                         if OPEN.startswith(self._held[-k:])), 0)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        self._sent += out
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the reply's end: the content still to send, and its tool calls."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        _content, calls = split_calls(self._sent + held, self.use)
        return ("", calls) if calls else (held, [])

