"""A hostile caller's structured-output and tool fields: each a typed refusal naming its field, never a 500.

Found by the closing adversarial pass of issue 25 (each case was a 500 ``internal_error``, an untyped
``TypeError`` / ``RecursionError`` / ``UnicodeEncodeError`` from the engine, or a reply that could not be
built): a ``tool_choice`` naming its function with a list, an assistant's ``tool_calls`` arguments nested
past Python's recursion limit, a ``guided_json`` text nested as deep, a spec holding a lone surrogate,
a reply (forced by ``guided_regex`` beside ``tools``) whose ``<tool_call>`` block names a list, a schema
bound past a 64-bit float, and names with a final newline that OpenAI's rule refuses.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from asyncinfer import AsyncEngine, InvalidParameterError, SamplingParams, StructuredOutput
from asyncinfer.server.errors import APIError
from asyncinfer.server.protocol import parse_chat
from asyncinfer.server.responses import Reply
from asyncinfer.server.tools import ToolUse, parse_tool_use, read_calls

from .conftest import TINY_OPTIONS

pytest.importorskip("llguidance", reason="structured output needs asyncinfer[structured] (llguidance)")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
ROLL = {"type": "function", "function": {"name": "roll", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}
DEEP = "[" * 100_000  # past any recursion limit of Python's json and of the interpreter


def _refused(body: dict, param: str) -> str:
    with pytest.raises(APIError) as refused:
        parse_chat(body)
    assert (refused.value.status, refused.value.param) == (400, param), refused.value.body()
    return refused.value.message


@pytest.mark.parametrize("name", [["x"], {"a": 1}, 5, None])
def test_a_tool_choice_naming_no_string_is_a_400_on_tool_choice(name) -> None:
    """It was a TypeError (an unhashable name looked up in the set of names): a 500."""
    _refused({**CHAT, "tools": [ROLL], "tool_choice": {"type": "function", "function": {"name": name}}}, "tool_choice")


def test_tool_call_arguments_nested_past_the_recursion_limit_are_a_400() -> None:
    """The assistant's ``arguments`` is a string, so the body's depth check never saw its nesting: json.loads
    raised RecursionError (a 500)."""
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "roll", "arguments": DEEP}}]},
        {"role": "user", "content": "again"}]
    _refused({**CHAT, "messages": history}, "messages.[0].tool_calls.[0].function.arguments")


@pytest.mark.parametrize("text", [DEEP, '{"a":' * 20_000])
def test_a_json_schema_text_nested_past_the_recursion_limit_is_refused_by_name(text) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        StructuredOutput.json_schema(text[:60_000])
    assert refused.value.parameter == "structured"
    with pytest.raises(InvalidParameterError) as refused:
        StructuredOutput(kind="json_schema", value=text[:60_000])
    assert refused.value.parameter == "structured"
    _refused({**CHAT, "guided_json": text[:60_000]}, "guided_json")


SURROGATE_SPECS = {
    "regex": lambda: StructuredOutput.regex("a\ud800"),
    "choice": lambda: StructuredOutput.choice(["a", "b\udfff"]),
    "grammar": lambda: StructuredOutput.grammar('start: "a\ud800"'),
    "schema value": lambda: StructuredOutput.json_schema({"enum": ["\ud800"]}),
    "schema key": lambda: StructuredOutput.json_schema({"type": "object", "properties": {"\udc00": {}}}),
    "schema text": lambda: StructuredOutput.json_schema('{"enum": ["\\ud800"]}'),
}


@pytest.mark.parametrize("build", SURROGATE_SPECS.values(), ids=SURROGATE_SPECS)
def test_a_spec_with_a_lone_surrogate_is_refused_when_built(build) -> None:
    """No grammar library can read it: it was a UnicodeEncodeError from the compile (a 500 over HTTP)."""
    with pytest.raises(InvalidParameterError) as refused:
        build()
    assert refused.value.parameter == "structured" and "surrogate" in str(refused.value)


@pytest.mark.parametrize(("field", "value"), [("guided_regex", "a\ud800"), ("guided_choice", ["\ud800"]),
                                              ("guided_grammar", 'root ::= "\ud800"'),
                                              ("guided_json", {"enum": ["\ud800"]})])
def test_a_guided_field_with_a_lone_surrogate_is_a_400_naming_it(field, value) -> None:
    _refused({**CHAT, field: value}, field)


def test_tool_parameters_with_a_lone_surrogate_are_a_400_naming_them() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"\ud800": {"type": "string"}}}}}
    _refused({**CHAT, "tools": [tool], "tool_choice": "required"}, "tools.[0].function.parameters")


@pytest.mark.parametrize("name", ["roll\n", "p\n"])
def test_names_follow_openais_rule_to_their_last_character(name) -> None:
    """``$`` matched before a final newline: "roll\\n" passed as a function name, "p\\n" as a schema name."""
    tool = {"type": "function", "function": {"name": name}}
    _refused({**CHAT, "tools": [tool]}, "tools.[0].function.name")
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": {"type": "object"}}}
    _refused({**CHAT, "response_format": fmt}, "response_format.json_schema.name")


def test_tools_whose_call_grammar_outgrows_the_spec_limit_are_a_400_on_tools() -> None:
    """Each tool's parameters fit, all of them together in the calls' grammar do not: the 400 named
    ``structured``, which is no field of the body."""
    params = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 400}
                                               for i in range(20)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(16)]
    message = _refused({**CHAT, "tools": tools, "tool_choice": "required"}, "tools")
    assert "65536" in message


def _auto(*tools: dict) -> ToolUse:
    use = parse_tool_use(list(tools), "auto", None)
    assert use is not None
    return use


@pytest.mark.parametrize("block", ['{"name": ["roll"], "arguments": {}}', '{"name": {"a": 1}, "arguments": {}}',
                                   "[" * 5000, '{"name": "roll", "arguments": ' + "[" * 5000])
def test_a_written_block_that_is_no_call_is_content_whatever_it_holds(block) -> None:
    """A model writes what it likes under ``"auto"``: a block naming a list (unhashable) or nested past the
    recursion limit raised out of the reply's parsing (a 500 for a whole answer, an error event for a stream)."""
    text = f"<tool_call>\n{block}\n</tool_call>"
    assert read_calls(text, _auto(ROLL)) == (text, [], False)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_reply_naming_a_list_beside_auto_tools_is_answered_as_content(stream) -> None:
    """``guided_regex`` beside ``tools`` (``"auto"``) lets a caller make the model write such a block: the whole
    answer's body raised (a 500) and a stream's chunk raised (its error event); both carry it as content now."""
    written = '<tool_call>\n{"name": ["roll"], "arguments": {}}\n</tool_call>'
    reply = Reply(True, "chatcmpl-x", 0, "tiny", None, False, tools=_auto(ROLL))
    if not stream:
        message = reply.choice(0, written, None, "stop")["message"]
        assert (message["content"], message.get("tool_calls")) == (written, None)
        return
    pieces = [reply.delta_chunk(0, written[:20], None, None), reply.delta_chunk(0, written[20:], None, "stop")]
    chunks = [json.loads(line.removeprefix(b"data: ")) for piece in pieces for line in piece.split(b"\n\n") if line]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == written
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_engine_refuses_such_specs_typed_and_serves_on(tiny_chat_model) -> None:
    """Specs the grammar library refuses by raising (a bare ``true``, a NaN, a bound past a 64-bit float:
    ``guided_json`` with ``{"minimum": 10**400}`` was a 500) are InvalidParameterErrors on ``structured``, and a
    neighbour's reply is untouched."""

    async def main() -> None:
        engine = AsyncEngine.from_pretrained(tiny_chat_model, **TINY_OPTIONS)
        async with engine:
            plain = SamplingParams(max_tokens=16, ignore_eos=True)
            alone = await engine.generate([5] * 8, plain)
            neighbour = asyncio.ensure_future(engine.generate([5] * 8, plain))
            for spec in (StructuredOutput(kind="json_schema", value="true"),  # llguidance raised ValueError on
                         StructuredOutput(kind="json_schema", value='{"minimum": NaN}'),  # each of these
                         StructuredOutput.json_schema({"type": "integer", "minimum": 10**400})):  # (guided_json: 500)
                with pytest.raises(InvalidParameterError) as refused:
                    await engine.generate("hi", SamplingParams(max_tokens=4, structured=spec))
                assert refused.value.parameter == "structured", spec
            assert (await neighbour).outputs[0].token_ids == alone.outputs[0].token_ids

    asyncio.run(main())


def _chain(rules: int) -> str:
    """A GBNF grammar of ``rules`` chained rules: the converter's cost grows with their square."""
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "x{i}" | r{i + 1}' for i in range(rules)) + f'\nr{rules} ::= "end"'


def test_a_long_gbnf_grammar_is_converted_outside_the_process(tiny_chat_model) -> None:
    """llguidance's GBNF-to-Lark converter is pure Python, quadratic in the rules: 2,000 rules took ~4 s of
    this process's CPU holding the GIL, and a neighbour's tokens took 17 times as long beside two such
    compiles. Past GBNF_IN_PROCESS_CHARS it runs in a child interpreter: this process spends next to nothing,
    and what the converter says (a valid grammar, or its reason to refuse one) is the same."""
    from transformers import AutoTokenizer

    from asyncinfer.grammar import GrammarCompiler

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_chat_model), 320, [2])
    compiler.compile(StructuredOutput.choice(["ok"]))  # the vocabulary view, built once
    spec = StructuredOutput.grammar(_chain(2000))
    assert len(spec.value) > 4096  # asyncinfer.grammar.GBNF_IN_PROCESS_CHARS
    cpu = time.process_time()
    with pytest.raises(InvalidParameterError) as refused:  # the library's lexer limit, after the conversion
        compiler.compile(spec)
    assert time.process_time() - cpu < 0.5
    assert refused.value.parameter == "structured" and "too big" in refused.value.allowed
    words = " | ".join(f'"w{i}"' for i in range(800))
    assert compiler.compile(StructuredOutput.grammar(f"root ::= {words}")).spec.kind == "grammar"  # converted apart
    with pytest.raises(InvalidParameterError) as refused:
        compiler.compile(StructuredOutput.grammar(f"root ::= {words} | ("))
    assert "GBNF or Lark" in refused.value.allowed
